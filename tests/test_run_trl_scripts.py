"""TRL's own training script (``trl/scripts/sft.py``, as its wheel ships it; ``trl sft``
launches it through ``accelerate launch`` in a child process, so it is run as the module
``-m trl.scripts.sft``) on a tiny Llama and local data made here (tests/programs/trl_tiny.py),
under `vramledger run` (issue 31): ``--target cpu`` against the same command run plainly
(``run --measure``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vramledger.inputs.program import ProgramSpec
from vramledger.measure.program import measure_program
from vramledger.predict.program import run_program

from .plain_run import PLAIN_RUN_RELATIVE

sys.path.insert(0, str(Path(__file__).parent / "programs"))
import trl_tiny

STEPS = 3
ARGS = (
    *("--model_name_or_path", "model", "--dataset_name", "data", "--output_dir", "out"),
    *("--max_steps", "4", "--per_device_train_batch_size", "2", "--max_length", "64"),
    *("--report_to", "none", "--logging_steps", "1"),
)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    trl_tiny.make(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _model_bytes(folder: Path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = f.keys()
        return sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in names)  # fp32


@pytest.mark.slow
def test_trl_sft_script_matches_its_plain_cpu_run(workdir, capsys):
    """Its SFTConfig defaults (bf16 autocast, activation checkpointing, TRL's chunked log-prob
    loss). The plain CPU run keeps the weights ``from_pretrained`` read in the safetensors
    file's memory map (its ``.to("cuda")`` on the CPU is the tensor itself), outside the CPU
    allocator's count; a GPU run copies them onto the device, as the prediction counts: the
    plain run is the prediction less the model, plus the host tensors named and activation
    checkpointing's CPU RNG states, within the plain-run bound."""
    spec = ProgramSpec(program="trl.scripts.sft", module=True, args=ARGS, max_steps=STEPS)
    predicted = run_program(spec, target="cpu")
    measured = measure_program(spec)
    capsys.readouterr()
    model = _model_bytes(workdir / "model")
    host = sum(h.nbytes for h in predicted.host_tensors)
    assert predicted.steps == measured.steps == STEPS
    for step, peak in predicted.step_peaks.items():
        truth = measured.step_peaks[step]
        assert abs(truth + model - peak - host) <= PLAIN_RUN_RELATIVE * truth, (step, peak, truth)
