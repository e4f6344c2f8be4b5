"""LitGPT's own commands under `vramledger run` (issue 20): `litgpt finetune_lora`,
`finetune_full` and `pretrain`, run by their console script on a tiny Llama-shaped checkpoint and
local data made here (tests/programs/litgpt_tiny.py; nothing is downloaded), against the same
command run for real on CPU (`run --measure`).

LitGPT's Fabric takes the emulated GPU (`accelerator="auto"`), so the precision is the one a
GPU run gets by default (bf16-mixed: Lightning's CUDA autocast) unless asked; `pretrain`
compiles the model (`torch.compile`, modelled as Inductor runs it) and steps a fused AdamW.
`--quantize bnb.nf4` runs with bitsandbytes' quantization emulated on the GPU
(``bnb_weights.py``); its real CPU run is refused in one line (Lightning quantizes only on CUDA).

litgpt 0.5.9 comes with the ``frameworks`` extra (CI installs it; pyproject says why that
version).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramledger.cli import main
from vramledger.inputs.categories import Category
from vramledger.inputs.errors import TraceError
from vramledger.inputs.program import ProgramSpec
from vramledger.measure.program import measure_program
from vramledger.predict.program import run_program

from .plain_run import assert_matches_plain_run

PROGRAMS = Path(__file__).parent / "programs"
STEPS = 3
"""Optimizer steps run (`--max-steps`): the first, and a steady window of two."""

COMMON = (
    "--train.global_batch_size",
    "2",
    "--train.micro_batch_size",
    "2",
    "--train.lr_warmup_steps",
    "1",
    "--eval.interval",
    "1000",
    "--eval.final_validation",
    "false",
    "--devices",
    "1",
    "--out_dir",
    "out",
    "--logger_name",
    "csv",
)
FINETUNE = (
    "checkpoint",
    "--data",
    "JSON",
    "--data.json_path",
    "data.json",
    "--data.val_split_fraction",
    "0.25",
    "--data.num_workers",
    "0",
    "--train.epochs",
    "100",
    "--train.max_steps",
    "100",
)
COMMANDS = {
    # the default precision a GPU gets: bf16-mixed
    "finetune_lora": ("finetune_lora", *FINETUNE),
    "finetune_full": ("finetune_full", *FINETUNE, "--precision", "bf16-true"),
    "pretrain": (
        "pretrain",
        "tiny",
        "--model_config",
        "checkpoint/model_config.yaml",
        "--data",
        "litgpt_tiny.TinyTokens",
        "--tokenizer_dir",
        "checkpoint",
        "--train.max_seq_length",
        "64",
        # pretrain takes no max_steps: 100 steps of 2 x 64 tokens
        "--train.max_tokens",
        "12800",
    ),
}
"""Each command's arguments after ``litgpt`` (run in the folder litgpt_tiny.make filled)."""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A tiny checkpoint and data in the working folder; litgpt_tiny importable (the
    pretraining data module, given to litgpt as ``--data litgpt_tiny.TinyTokens``)."""
    monkeypatch.syspath_prepend(str(PROGRAMS))
    from litgpt_tiny import make

    make(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _spec(command: str, *extra: str) -> ProgramSpec:
    return ProgramSpec(
        program="litgpt", args=(*COMMANDS[command], *COMMON, *extra), max_steps=STEPS
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_litgpt_command_matches_the_real_cpu_run(command, workdir):
    """--target cpu predicts the real CPU run's allocator count, step by step and in the steady
    window, within 0.5 % once the host tensors it names are added (LitGPT's DataLoader keeps the
    next batch on the host; LitGPT would run 100 steps, vramledger stops it after three, before
    its final save and merge)."""
    spec = _spec(command)
    predicted = run_program(spec, target="cpu")
    measured = measure_program(spec)
    assert predicted.steps == measured.steps == STEPS
    assert predicted.ending == measured.ending == "max-steps"
    assert_matches_plain_run(predicted, measured)
    [window] = predicted.windows
    assert window.optimizer == "AdamW"
    notes = " ".join(predicted.notes)
    # the notes name LitGPT's lines (the console script's package is the program)
    assert f"{command.removeprefix('finetune_')}.py:" in notes
    if command == "pretrain":
        assert "modelled as Inductor runs them: GPT (torch.compile'd module)" in notes
        assert "could not be modelled" not in notes
    if command == "finetune_lora":
        assert "torch.autocast('cuda') to bfloat16" in notes
    if command != "pretrain":  # lit_model.pth, read by Lightning's lazy loader: mapped
        assert "weights read as shapes from checkpoint/lit_model.pth (no data read)" in notes


QUANTIZED_WEIGHTS = 45_056 + 5_632
"""The tiny model's 90,112 weights of its 11 linears (two blocks' qkv, proj, fc_1, fc_2 and
mlp.proj, and the head) in LitGPT's ``bnb.nf4`` (no double quantization): packed two per byte,
and one fp32 absmax per 64."""


@pytest.mark.slow
def test_quantize_bnb_nf4_runs_on_the_emulated_gpu(workdir, capsys):
    """QLoRA through Lightning's bitsandbytes plugin: its layers quantize at construction on the
    emulated GPU and again when the checkpoint loads (bnb_weights.py), bitsandbytes' PagedAdamW
    steps the adapters. The real CPU run cannot run it (Lightning quantizes only on CUDA): one
    line says so, not labelled the program's."""
    spec = _spec("finetune_lora", "--precision", "bf16-true", "--quantize", "bnb.nf4")
    report = run_program(spec, gpu="h100-80gb")
    assert report.steps == STEPS
    assert [w.optimizer for w in report.windows] == ["PagedAdamW"]
    assert report.ledger is not None
    assert report.ledger.at_peak[Category.PARAMETERS] >= QUANTIZED_WEIGHTS
    assert any(
        n.startswith("bitsandbytes quantized weights on the emulated GPU") for n in report.notes
    )
    with pytest.raises(TraceError, match="Lightning's BitsandbytesPrecision"):
        measure_program(spec)
    capsys.readouterr()
    assert main(["run", "--measure", "--", "litgpt", *spec.args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vramledger: error: the program quantizes with Lightning's")
    assert not any("the program raised" in line for line in err)  # not labelled the program's
