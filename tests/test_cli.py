"""The command line: the JSON contract, and one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from vramledger.cli import main

from .conftest import MODELS_PY, fixture

CORE_FIELDS = {
    "peak_bytes",
    "allocated_peak_bytes",
    "first_step_peak_bytes",
    "peak_phase",
    "at_peak",
    "phases",
    "parameters",
    "trainable_parameters",
    "target",
    "vramledger_version",
}


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_json_contract(capsys):
    code, out, _ = run_cli(
        capsys,
        "estimate",
        fixture("tiny-llama.json"),
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--precision",
        "bf16-master",
        "--grad-checkpointing",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert set(data) >= CORE_FIELDS
    assert sum(data["at_peak"].values()) == data["peak_bytes"]
    assert data["target"] == "cuda"
    assert data["peak_phase"] in data["phases"]
    assert data["parameters"] == data["trainable_parameters"] > 0


def test_measure_json_contract(capsys):
    code, out, _ = run_cli(
        capsys, "measure", fixture("tiny-gpt2.json"), "--seq-len", "16", "--compare", "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert CORE_FIELDS | {"measured_peak_bytes", "estimate", "estimate_error"} <= set(data)
    assert abs(data["estimate_error"]) < 0.005


def test_terminal_table(capsys):
    code, out, _ = run_cli(
        capsys,
        "estimate",
        fixture("tiny-gpt2.json"),
        "--seq-len",
        "16",
        "--optimizer",
        "sgd-momentum",
    )
    assert code == 0
    for word in ("parameters", "optimizer_state", "activations", "peak by phase", "backward"):
        assert word in out


PLAIN = ["--inputs", f"{MODELS_PY}:mlp_inputs", "--loss", f"{MODELS_PY}:mlp_loss"]
BAD = {
    "missing config": (["estimate", "no/such/config.json"], "not found"),
    "malformed config": (["estimate", fixture("bad/truncated.json")], "not valid JSON"),
    "config without model_type": (["estimate", fixture("bad/no-model-type.json")], "model_type"),
    "unknown model type": (["estimate", fixture("bad/unknown-type.json")], "not-a-model"),
    # issue 32: it grew to 20 GB before it was killed
    "world size beyond any cluster": (
        ["estimate", fixture("tiny-llama.json"), "--world-size", "100000000"],
        "world-size 100,000,000 is beyond any training cluster",
    ),
    "unknown task": (
        ["estimate", fixture("tiny-llama.json"), "--task", "translation"],
        "invalid choice",
    ),
    "task the model lacks": (
        ["estimate", fixture("tiny-vit.json"), "--task", "causal-lm"],
        "causal-lm",
    ),
    "unknown optimizer": (
        ["estimate", fixture("tiny-llama.json"), "--optimizer", "adamm"],
        "unknown optimizer",
    ),
    "bad kwargs json": (
        ["estimate", fixture("tiny-llama.json"), "--optimizer-kwargs", "{momentum: 1}"],
        "not valid JSON",
    ),
    "kwargs not an object": (
        ["estimate", fixture("tiny-llama.json"), "--optimizer-kwargs", "[1]"],
        "JSON object",
    ),
    "unknown kwarg": (
        [
            "estimate",
            fixture("tiny-llama.json"),
            "--optimizer",
            "sgd",
            "--optimizer-kwargs",
            '{"momentom": 0.9}',
        ],
        "momentom",
    ),
    "zero batch": (
        ["estimate", fixture("tiny-llama.json"), "--batch-size", "0"],
        "batch-size must be a positive",
    ),
    "negative seq": (
        ["estimate", fixture("tiny-llama.json"), "--seq-len", "-3"],
        "seq-len must be a positive",
    ),
    "one step": (
        ["estimate", fixture("tiny-llama.json"), "--steps", "1"],
        "steps must be at least 2",
    ),
    "too long for positions": (
        ["estimate", fixture("tiny-gpt2.json"), "--seq-len", "4096"],
        "learned positions",
    ),
    "factory raises": (["estimate", f"{MODELS_PY}:broken_factory", *PLAIN], "always fails"),
    "factory returns junk": (["estimate", f"{MODELS_PY}:not_a_module", *PLAIN], "not an nn.Module"),
    "missing function": (["estimate", f"{MODELS_PY}:nope"], "no function 'nope'"),
    "no loss for plain model": (
        ["estimate", f"{MODELS_PY}:mlp", "--inputs", f"{MODELS_PY}:mlp_inputs"],
        "--loss",
    ),
    "no inputs for plain model": (["estimate", f"{MODELS_PY}:mlp"], "--inputs"),
    "checkpoint class missing": (
        ["estimate", fixture("tiny-llama.json"), "--checkpoint-modules", "Nope"],
        "no submodule of class Nope",
    ),
    "unknown GPU": (["plan", fixture("tiny-llama.json"), "--gpu", "a999"], "unknown GPU 'a999'"),
    "no GPU": (["plan", fixture("tiny-llama.json")], "no GPU given"),
    "bad GPU memory": (
        ["advise", fixture("tiny-llama.json"), "--gpu-memory", "lots"],
        "cannot read 'lots'",
    ),
    "unknown precision to plan": (
        ["plan", fixture("tiny-llama.json"), "--gpu", "l4", "--precisions", "fp8"],
        "unknown precision 'fp8'",
    ),
    "unknown optimizer to plan": (
        ["plan", fixture("tiny-llama.json"), "--gpu", "l4", "--optimizers", "adamw,nope"],
        "nope",
    ),
    "missing rehearsal file": (
        ["plan", fixture("tiny-llama.json"), "--gpu", "l4", "--margin-from", "/nonexistent.json"],
        "rehearsal file /nonexistent.json not found",
    ),
    "rehearsal file without residual": (
        [
            "advise",
            fixture("tiny-llama.json"),
            "--gpu",
            "l4",
            "--margin-from",
            fixture("tiny-llama.json"),
        ],
        "no residual_bytes",
    ),
    "rehearse a plain model": (
        [
            "rehearse",
            f"{MODELS_PY}:mlp",
            "--inputs",
            f"{MODELS_PY}:mlp_inputs",
            "--loss",
            f"{MODELS_PY}:mlp_loss",
        ],
        "Hugging Face config",
    ),
    "rehearse as deep as the model": (
        ["rehearse", fixture("tiny-llama.json"), "--depths", "1,2"],
        "below the model's 2 layers",
    ),
    "rehearse bad depths": (
        ["rehearse", fixture("tiny-llama.json"), "--depths", "a,b"],
        "--depths must be integers",
    ),
    "data-dependent operator": (
        [
            "estimate",
            f"{MODELS_PY}:data_dependent",
            "--inputs",
            f"{MODELS_PY}:mlp_inputs",
            "--loss",
            f"{MODELS_PY}:mlp_loss",
        ],
        "aten.",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_nonzero(capsys, case):
    args, expected = BAD[case]
    try:
        code, _out, err = run_cli(capsys, *args)
    except SystemExit as exc:  # argparse's own errors (invalid choice)
        code, err = exc.code, capsys.readouterr().err
    assert code != 0
    assert expected in err, err
    assert "Traceback" not in err
    if case != "unknown task":
        assert len(err.strip().splitlines()) == 1, err


def test_data_dependent_error_names_operator_and_module_and_suggests_measure(capsys):
    args, _ = BAD["data-dependent operator"]
    for target in ("cuda", "cpu"):
        code, _, err = run_cli(capsys, *args, "--target", target)
        assert code == 2
        assert "_local_scalar_dense" in err or "is_nonzero" in err
        assert "module" in err and "parameters" in err and "measure" in err
        # the CPU path has the same limit: suggesting --target cpu would not be true
        assert "--target cpu" not in err


def test_process_exit_code_and_debug_traceback():
    cmd = [sys.executable, "-m", "vramledger", "estimate", fixture("bad/truncated.json")]
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    loud = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, timeout=120)
    assert loud.returncode != 0 and "Traceback" in loud.stderr


def test_plan_json_contract(capsys):
    code, out, _ = run_cli(
        capsys,
        "plan",
        fixture("tiny-llama.json"),
        "--gpu-memory",
        "100MiB",
        "--margin",
        "0",
        "--max-gpus",
        "8",
        "--optimizers",
        "adamw,sgd-momentum",
        "--seq-len",
        "32",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert set(data["fewest_gpus"]) == {"adamw", "sgd-momentum"}
    for entry in [*data["fewest_gpus"].values(), *data["front"]]:
        assert {"gpus", "configuration", "peak_bytes_per_gpu", "headroom_bytes"} <= set(entry)
        assert entry["peak_bytes_per_gpu"] + entry["headroom_bytes"] == 100 * 1024**2
    assert data["front"] and all("costs" in c for c in data["front"])
    assert data["margin_bytes"] == 0


def test_advise_says_when_it_already_fits(capsys):
    code, out, _ = run_cli(
        capsys, "advise", fixture("tiny-llama.json"), "--gpu", "h100-80gb", "--seq-len", "32"
    )
    assert code == 0 and "fits" in out


def test_piped_tables_are_not_cut_to_80_columns(capsys, monkeypatch):
    """Output that is not a terminal (a pipe, a file, capsys) gets each table at its natural
    width: no cell cut to 'checkpoi…', every note on one line, as the JSON says it."""
    monkeypatch.delenv("COLUMNS", raising=False)
    args = ["estimate", fixture("tiny-llama.json"), "--seq-len", "32", "--grad-checkpointing"]
    args += ["--world-size", "2", "--strategy", "fsdp"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and "…" not in out
    _, as_json, _ = run_cli(capsys, *args, "--json")
    for note in json.loads(as_json)["notes"]:
        assert f"note: {note}" in out


def test_optimizer_state_is_said_per_rank_and_over_all_ranks(capsys, monkeypatch):
    """FSDP over 4 ranks: AdamW's 8 bytes per parameter are 2 on each rank; the line says which
    is which, and the JSON gives the sum over every rank."""
    monkeypatch.delenv("COLUMNS", raising=False)  # piped: nothing is cut or wrapped
    args = ["estimate", fixture("tiny-llama.json"), "--seq-len", "32"]
    args += ["--world-size", "4", "--strategy", "fsdp"]
    _, out, _ = run_cli(capsys, *args)
    line = next(x for x in out.splitlines() if x.startswith("optimizer state:"))
    assert "on rank 0 (2.00 bytes per trainable parameter of the whole model)" in line
    assert "over all 4 ranks (8.00 bytes/parameter)" in line
    _, as_json, _ = run_cli(capsys, *args, "--json")
    data = json.loads(as_json)
    assert data["optimizer_state_bytes_all_ranks"] == sum(
        len(r["rank_ids"]) * r["optimizer_state_bytes"] for r in data["ranks"]
    )
    # m and v: 8 bytes per parameter, and a 4-byte step counter per parameter tensor
    assert 0 <= data["optimizer_state_bytes_all_ranks"] - 8 * data["trainable_parameters"] < 1024


def test_lora_target_hint_lists_every_layer_peft_adapts(capsys):
    """GPT-2's attention and MLP are transformers' Conv1D, which peft's LoRA adapts: the hint
    names them, not only the Linear head, and one of them works."""
    base = ["estimate", fixture("tiny-gpt2.json"), "--seq-len", "16", "--target", "cpu"]
    code, _, err = run_cli(capsys, *base, "--lora", "r=4,alpha=8,targets=q_proj")
    assert code == 2
    hint = err.split("peft's LoRA adapts:")[1]
    assert {"c_attn", "c_fc", "c_proj", "lm_head"} <= {n.strip() for n in hint.split(",")}
    code, out, _ = run_cli(capsys, *base, "--lora", "r=4,alpha=8,targets=c_attn", "--json")
    assert code == 0 and json.loads(out)["trainable_parameters"] > 0


def test_python_api_is_as_quiet_as_the_cli():
    """`import vramledger` and `estimate(...)` print nothing (torchao's failed kernel loads,
    torch's pytree registrations, transformers' advisories are the CLI's chatter too), and the
    caller's logging levels and warning filters are as they were. (``import vramledger`` imports
    no torch; ``from vramledger import estimate`` does, and torch's import adds its own warning
    filters, as importing torch does anywhere.)"""
    code = (
        "import logging, warnings\n"
        "import vramledger\n"
        "from vramledger import estimate\n"
        "before = (list(warnings.filters), logging.getLogger('transformers').level)\n"
        f"vramledger.estimate(model={fixture('tiny-gpt2.json')!r}, seq_len=16, "
        "grad_checkpointing=True, optimizer='adamw8bit')\n"
        "assert (list(warnings.filters), logging.getLogger('transformers').level) == before\n"
    )
    run = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "" and run.stderr == ""


def test_every_answer_says_which_frameworks_mode_it_models(capsys):
    """bf16-master under FSDP runs FSDP2's own mixed precision: the dtype note says so (it was
    an empty description)."""
    args = ["estimate", fixture("tiny-llama.json"), "--seq-len", "16", "--precision"]
    args += ["bf16-master", "--world-size", "2", "--strategy", "fsdp", "--json"]
    _, out, _ = run_cli(capsys, *args)
    (note,) = [n for n in json.loads(out)["notes"] if n.startswith("--precision bf16-master:")]
    assert "MixedPrecisionPolicy" in note and not note.startswith("--precision bf16-master: ;")
