"""torchtune's own recipes with torchtune's own configs, as its wheel ships them
(``llama3_2/1B_lora_single_device``, ``1B_qlora_single_device``, ``1B_full_single_device``),
made tiny and pointed at local files by command-line overrides
(tests/programs/torchtune_recipes.py), under `vramledger run` (issue 31):

- ``--target cpu`` against the same command run plainly on the CPU (``run --measure``), within
  0.5 % once the host tensors it names are added (tests/plain_run.py), with the features the
  configs offer: torch.compile, activation checkpointing, activation offloading, QLoRA's NF4
  weights, and the full recipe's ``optimizer_in_bwd`` with bitsandbytes' ``PagedAdamW8bit``;
- ``--gpu``: the recipe takes the GPU's code paths, and the answer says which.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramledger.inputs.program import ProgramSpec
from vramledger.measure.program import measure_program
from vramledger.predict.program import run_program

from .plain_run import assert_matches_plain_run

sys.path.insert(0, str(Path(__file__).parent / "programs"))
import torchtune_recipes

STEPS = 3
"""Optimizer steps run (the recipe would run ``max_steps_per_epoch``, 4, then save)."""
IN_BACKWARD = "PagedAdamW8bit (one per parameter, stepped in backward)"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchtune")
    torchtune_recipes.make(root)
    return root


@pytest.fixture
def workdir(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(checkpoint)
    return checkpoint


def _spec(name: str, *overrides: str) -> ProgramSpec:
    return ProgramSpec(
        program="tune", args=torchtune_recipes.command(name, *overrides), max_steps=STEPS
    )


COMPILE_AC = ("compile=True", "enable_activation_checkpointing=True")
CASES = {
    # LoRA with every memory feature of its config: compiled layers inside their checkpoint
    # wrappers, activations offloaded to (pinned) host memory
    "lora-compile-ac-offload": ("lora", (*COMPILE_AC, "enable_activation_offloading=True")),
    "qlora": ("qlora", ()),
    # one PagedAdamW8bit per parameter, stepped in the backward (optimizer_in_bwd: True)
    "full": ("full", ()),
    "full-compile-ac": ("full", COMPILE_AC),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_recipe_matches_its_plain_cpu_run(case, workdir, capsys):
    name, overrides = CASES[case]
    spec = _spec(name, *overrides)
    predicted = run_program(spec, target="cpu")
    measured = measure_program(spec)
    capsys.readouterr()
    assert predicted.steps == STEPS
    assert_matches_plain_run(predicted, measured)
    if name == "full":
        # one training step per backward, not one per parameter's optimizer
        assert [w.optimizer for w in predicted.windows] == [IN_BACKWARD]
        notes = " ".join(predicted.notes)
        assert "bitsandbytes::optimizer_update_8bit_blockwise ran as its Python CPU kernel" in notes


@pytest.mark.slow
def test_full_recipe_on_the_gpu_keeps_paged_states_outside_the_allocator(workdir, capsys):
    """On the GPU the full recipe's ``PagedAdamW8bit`` keeps its large states in CUDA unified
    memory: not in the allocator's peak, named with their bytes."""
    report = run_program(_spec("full"), gpu="h100-80gb")
    capsys.readouterr()
    assert report.steps == STEPS
    assert [w.optimizer for w in report.windows] == [IN_BACKWARD]
    # 2 uint8 states per element of every tensor of 1e5 elements or more: the tied embedding
    # (128,256 x 128) alone is 16,416,768 elements
    assert report.unified_memory_bytes >= 2 * 128_256 * 128
    assert report.ledger is not None
    assert report.ledger.optimizer_state_bytes < report.unified_memory_bytes / 10
    assert any(n.startswith("paged optimizer states:") for n in report.notes)
    assert any("GPU code paths" in n for n in report.notes)


@pytest.mark.slow
def test_packed_lora_attends_with_flex_attention_on_the_gpu(workdir):
    """torchtune decides when it is imported whether FlexAttention is supported (a GPU of
    compute capability 7.5 or more): on the emulated GPU a packed dataset attends with it, not
    with a dense mask and plain attention, and the answer names it. In a fresh process: this
    one imported torchtune on the CPU."""
    args = torchtune_recipes.command("lora", "dataset.packed=True", "tokenizer.max_seq_len=64")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "vramledger", "run", "--json", "--no-cache"),
            *("--gpu", "h100-80gb", "--max-steps", str(STEPS), "--", "tune", *args),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["steps"] == STEPS
    [paths] = [n for n in report["notes"] if n.startswith("GPU code paths:")]
    assert "flex_attention ×" in paths and "flex_attention_backward ×" in paths


@pytest.mark.slow
def test_qlora_compiled_on_the_gpu(workdir, capsys):
    """torchao's NF4 weights wrap the emulated tensors (their wrapper is made on the host
    device, their data on the emulated GPU); compiled layers inside checkpoint wrappers."""
    report = run_program(_spec("qlora", *COMPILE_AC), gpu="h100-80gb")
    capsys.readouterr()
    assert report.steps == STEPS
    assert report.ledger is not None
