"""torchtune's LoRA recipe under `vramledger run` (issue 20): `tune run
lora_finetune_single_device`, its console script, on a tiny Llama-2-shaped checkpoint in each
format a checkpointer of torchtune reads (Hugging Face safetensors, Meta's torch.save), a
SentencePiece tokenizer and local Alpaca-style data made here
(tests/programs/torchtune_tiny.py; nothing is downloaded), against the same command run for
real on CPU (`run --measure`).

The recipe's config asks for ``device: cuda`` and ``dtype: bf16`` (torchtune's own
single-device LoRA settings): bf16 is allowed where ``torch.cuda.is_bf16_supported()`` and
NCCL >= 2.10 (``training.verify_bf16_support``), which the emulation answers as a CUDA build.

torchtune 0.6.1 comes with the ``frameworks`` extra (CI installs it; pyproject says why its
torchao is 0.15).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramledger.inputs.categories import Category
from vramledger.inputs.program import ProgramSpec
from vramledger.measure.program import measure_program
from vramledger.predict.program import run_program

PROGRAMS = Path(__file__).parent / "programs"
STEPS = 3
"""Optimizer steps run (`--max-steps`): the first, and a steady window of two (the recipe
would run an epoch of 4 and then save)."""
COMMAND = ("run", "lora_finetune_single_device", "--config", "config.yaml")
"""``tune``'s arguments (run in the folder torchtune_tiny.make filled)."""
LORA_PARAMETERS = 16_384
"""The adapters' parameters, rank 8 on q, v, output and the three MLP projections of 2 layers:
what the optimizer steps (torchtune gives it every parameter; the frozen ones get no
gradient)."""


def _workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> Path:
    monkeypatch.syspath_prepend(str(PROGRAMS))
    from torchtune_tiny import make

    make(tmp_path, fmt)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _spec() -> ProgramSpec:
    return ProgramSpec(program="tune", args=COMMAND, max_steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "weights"),
    [("hf", "checkpoint/model.safetensors"), ("meta", "checkpoint/consolidated.00.pth")],
)
def test_lora_recipe_matches_the_real_cpu_run(fmt, weights, tmp_path, monkeypatch, capsys):
    """--target cpu predicts the real CPU run's allocator count, step by step and in the steady
    window, to the byte; the checkpoint is read as shapes (FullModelHFCheckpointer through
    ``safe_open``, FullModelMetaCheckpointer through ``torch.load(mmap=True)``)."""
    _workdir(tmp_path, monkeypatch, fmt)
    predicted = run_program(_spec(), target="cpu")
    measured = measure_program(_spec())
    capsys.readouterr()
    assert predicted.steps == measured.steps == STEPS
    assert predicted.ending == measured.ending == "max-steps"
    assert predicted.step_peaks == measured.step_peaks
    [window] = predicted.windows
    [truth] = measured.windows
    assert window.optimizer == truth.optimizer == "AdamW (self._optimizer)"
    assert window.peak_bytes == truth.peak_bytes
    assert f"weights read as shapes from {weights} (no data read)" in predicted.notes
    # the recipe (run by `tune run` with runpy from site-packages) is the program: its lines
    assert any("lora_finetune_single_device.py:" in note for note in predicted.notes)
    assert predicted.ledger is not None
    assert predicted.ledger.trainable_parameters == LORA_PARAMETERS


@pytest.mark.slow
def test_lora_recipe_on_an_emulated_h100(tmp_path, monkeypatch, capsys):
    """The CUDA prediction runs the same recipe: bf16 weights on the device, cuBLAS's
    workspaces, cuDNN attention."""
    _workdir(tmp_path, monkeypatch, "hf")
    report = run_program(_spec(), gpu="h100-80gb")
    capsys.readouterr()
    assert report.steps == STEPS and report.ledger is not None
    assert report.ledger.verdict is not None
    assert report.at_peak[Category.PARAMETERS] > 0
    assert any("cuDNN attention" in note for note in report.notes)
