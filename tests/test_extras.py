"""Optional libraries a request needs (extras.py) are checked before any work: a missing one is
refused in one line with the pip command, and nothing is traced, trained or run before
(issue 32: "missing extras reported after minutes of work"). A library is made missing as
Python sees a failed import: ``sys.modules[name] = None``."""

import re
import sys
from pathlib import Path

import pytest

import vramledger.measure
import vramledger.measure.compare
import vramledger.plan.rehearse
import vramledger.predict.step
from vramledger.cli import main
from vramledger.inputs import extras
from vramledger.inputs.gpus import resolve_gpu
from vramledger.inputs.spec import TrainingSpec
from vramledger.plan.advise import advise

from .conftest import fixture

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
TINY = fixture("tiny-llama.json")
DS_ZERO2 = str(Path(__file__).resolve().parents[1] / "examples" / "ds_zero2_offload.json")


def test_each_package_is_in_the_extra_the_table_names():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for package, extra in extras.EXTRAS.items():
        names = {re.match(r"[A-Za-z0-9_-]+", r)[0].lower() for r in declared[extra]}
        assert package in names, (package, extra)


def test_optimizer_names_say_their_library_without_importing_it():
    package = extras.optimizer_package
    assert package("adamw") is None and package("sgd-momentum") is None
    assert package("adamw8bit") == package("ao-AdamW4bit") == "torchao"
    assert package("lion") == package("bnb-paged-adamw8bit") == "bitsandbytes"
    assert package("torchao.optim.AdamW8bit") == "torchao"
    assert package("adafactor-hf") == "transformers"
    assert package("deepspeed.ops.adam:FusedAdam") == "deepspeed"
    assert package("my_package.Optimizer") is None  # not an extra: its import says what
    assert package("opt.py:Optimizer") is None


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if an estimate traces, measure runs, compare trains or rehearse runs."""

    def ran(*args, **kwargs):
        raise AssertionError("the work started before the request was checked")

    monkeypatch.setattr(vramledger.predict.step, "trace", ran)
    monkeypatch.setattr(vramledger.measure, "measure", ran)
    monkeypatch.setattr(vramledger.measure.compare, "compare", ran)
    monkeypatch.setattr(vramledger.plan.rehearse, "rehearse", ran)


def missing(monkeypatch, *packages):
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)
        assert not extras.installed(package)


CASES = {
    "lora": (
        ["peft"],
        ["estimate", TINY, "--lora", "r=8,alpha=16,targets=q_proj"],
        "--lora needs peft",
    ),
    "quantize": (
        ["bitsandbytes"],
        ["estimate", TINY, "--quantize", "nf4"],
        "--quantize nf4 needs bitsandbytes",
    ),
    "deepspeed strategy": (
        ["deepspeed"],
        ["estimate", TINY, "--world-size", "2", "--strategy", "zero2"],
        "--strategy zero2 (DeepSpeed's own engine) needs deepspeed",
    ),
    "deepspeed config": (
        ["deepspeed"],
        ["estimate", TINY, "--world-size", "2", "--deepspeed", DS_ZERO2],
        f"--deepspeed {DS_ZERO2} (zero2, DeepSpeed's own engine) needs deepspeed",
    ),
    "optimizer": (
        ["torchao"],
        ["estimate", TINY, "--optimizer", "adamw8bit"],
        "--optimizer adamw8bit needs torchao",
    ),
    "hf config": (["transformers"], ["estimate", TINY], "a Hugging Face config needs transformers"),
    "measure": (
        ["peft"],
        ["measure", TINY, "--lora", "r=8,alpha=16,targets=q_proj"],
        "--lora needs peft",
    ),
    "compare's plot": (
        ["matplotlib"],
        ["compare", TINY, "--optimizers", "adamw,sgd", "--plot", "loss.png"],
        "--plot needs matplotlib",
    ),
    "compare's optimizers": (
        ["torchao"],
        ["compare", TINY, "--optimizers", "adamw,sgd,adamw8bit"],
        "--optimizers adamw8bit needs torchao",
    ),
    "rehearse's plot": (
        ["matplotlib"],
        ["rehearse", TINY, "--plot", "growth.png"],
        "--plot needs matplotlib",
    ),
    "two at once": (
        ["peft", "bitsandbytes"],
        ["estimate", TINY, "--lora", "r=8,alpha=16,targets=q_proj", "--quantize", "nf4"],
        "--lora needs peft and --quantize nf4 needs bitsandbytes, which are not installed; "
        "pip install 'vramledger[peft,lowbit]'",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_missing_extra_is_refused_before_any_work(
    case, monkeypatch, capsys, nothing_runs, tmp_path
):
    packages, args, expected = CASES[case]
    monkeypatch.chdir(tmp_path)  # where a plot would go
    missing(monkeypatch, *packages)
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("vramledger: error: ") and err.strip().count("\n") == 0, err
    assert expected in err
    extra = extras.EXTRAS[packages[0]]
    assert f"pip install 'vramledger[{extra}" in err


def test_advise_leaves_out_a_change_whose_library_is_missing(monkeypatch):
    """advise tries 8-bit AdamW states (torchao) only when not fitting; without torchao it tries
    the others and says what it left out, instead of failing at that change."""
    missing(monkeypatch, "torchao")
    spec = TrainingSpec(model=TINY, seq_len=16, margin=0)
    advice = advise(spec, resolve_gpu(memory="5MiB"), margin=0)
    assert not advice.fits
    assert "8-bit AdamW states" not in [c.name for c in advice.changes]
    assert "momentum SGD" in [c.name for c in advice.changes]
    assert any(
        n.startswith("8-bit AdamW states not tried: adamw8bit needs torchao")
        and "pip install 'vramledger[lowbit]'" in n
        for n in advice.notes
    )
