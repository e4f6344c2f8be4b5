"""`vramledger run` predicting a GPU run takes the GPU's code paths (issue 31): the program and
its libraries are told their tensors are CUDA tensors; host copies are host memory; a CPU state
dict loaded into the model on the GPU is counted once, on the device; a Triton kernel is not run
but named; the answer says which GPU paths were taken. And whose failure a failure is: the
program's only when its plain run fails too. And the command forms profilers accept
(``-- python train.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramledger.cli import main
from vramledger.inputs.categories import Category
from vramledger.inputs.errors import InputError
from vramledger.inputs.program import ProgramFailed, ProgramSpec, parse_command
from vramledger.measure.attribution import TraceFailed, run_program_checked
from vramledger.measure.program import measure_program
from vramledger.predict.program import run_program

from .plain_run import assert_matches_plain_run

PROGRAMS = Path(__file__).parent / "programs"
MODEL_BYTES = 4 * (256 * 256 + 256) * 4
"""gpu_paths.py's four fp32 Linear(256, 256) layers."""


def _spec(name: str, **kwargs) -> ProgramSpec:
    return ProgramSpec(program=str(PROGRAMS / f"{name}.py"), **kwargs)


def test_the_program_sees_cuda_tensors_on_the_gpu_and_cpu_ones_on_the_cpu(capsys):
    on_gpu = run_program(_spec("gpu_paths"), gpu="h100-80gb")
    gpu_out = capsys.readouterr().out
    assert "device: cuda:0 True 0" in gpu_out
    assert gpu_out.count("host: cpu False") == 3  # .cpu() of a result is a host tensor
    on_cpu = run_program(_spec("gpu_paths"), target="cpu")
    assert "device: cpu False -1" in capsys.readouterr().out  # a CPU run's paths
    assert on_gpu.ledger is not None and on_cpu.ledger is not None
    paths = [n for n in on_gpu.notes if n.startswith("GPU code paths:")]
    assert len(paths) == 1
    assert not any(n.startswith("GPU code paths:") for n in on_cpu.notes)


def test_a_cpu_state_dict_loaded_on_the_gpu_is_counted_once(capsys):
    """``model.cuda(); model.load_state_dict(cpu_state)``: the parameters are device memory
    once; the CPU state dict is host memory the program keeps, named with its bytes (it was
    counted as device memory too, a second copy of the model)."""
    report = run_program(_spec("gpu_paths"), gpu="h100-80gb")
    capsys.readouterr()
    assert report.ledger is not None
    assert report.ledger.at_peak[Category.PARAMETERS] == MODEL_BYTES
    # the state dict (MODEL_BYTES) and the offloaded host buffer (64 x 256 fp32)
    assert report.to_dict()["host_bytes"] >= MODEL_BYTES + 64 * 256 * 4


def test_triton_kernels_are_named_not_run(capsys):
    report = run_program(_spec("gpu_paths"), gpu="h100-80gb")
    capsys.readouterr()
    [launched] = [n for n in report.notes if n.startswith("Triton kernels")]
    assert "add_kernel ×3" in launched


@pytest.mark.slow
def test_gpu_paths_program_against_its_plain_cpu_run(capsys):
    predicted = run_program(_spec("gpu_paths"), target="cpu")
    measured = measure_program(_spec("gpu_paths"))
    capsys.readouterr()
    assert_matches_plain_run(predicted, measured)


def test_a_library_that_asks_for_a_gpu_while_imported_is_told_there_is_one(tmp_path):
    """torchtune decides at import whether FlexAttention is supported: in a fresh process, so
    that the module is first imported under the emulation."""
    program = tmp_path / "imports.py"
    program.write_text(
        "from torchtune.modules.attention_utils import _SUPPORTS_FLEX_ATTENTION\n"
        "print('flex:', _SUPPORTS_FLEX_ATTENTION)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "vramledger", "run", "--no-cache", "--", str(program)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "flex: True" in done.stdout, done.stderr[-2000:]


def test_the_programs_own_error_is_confirmed_by_its_plain_run(capsys):
    with pytest.raises(ProgramFailed) as info:
        run_program_checked(_spec("raises"), target="cuda", gpu="h100-80gb")
    assert info.value.confirmed
    assert "raised the same: the error is the program's" in info.value.hint
    assert main(["run", "--", str(PROGRAMS / "raises.py")]) == 1
    err = capsys.readouterr().err
    assert "the error is the program's, not vramledger's" in err


def test_a_failure_only_the_trace_has_is_vramledgers(capsys):
    with pytest.raises(TraceFailed) as info:
        run_program_checked(_spec("trace_only_failure"), target="cuda", gpu="h100-80gb")
    assert "where the program's plain run on the CPU made 1 step without error" in str(
        info.value.message
    )
    assert "not the program's" in info.value.hint
    assert main(["run", "--", str(PROGRAMS / "trace_only_failure.py")]) == 1
    err = capsys.readouterr().err
    assert "the error is the program's" not in err
    assert "the failure is vramledger's" in err


@pytest.mark.parametrize(
    "command",
    [
        ["python", "train.py", "--lr", "1"],
        [sys.executable, "train.py", "--lr", "1"],
        ["python3", "-u", "train.py", "--lr", "1"],
    ],
)
def test_the_interpreter_before_the_program_is_accepted(command):
    assert parse_command(command) == ("train.py", ("--lr", "1"), False)


def test_python_m_and_a_refused_interpreter_option():
    assert parse_command(["python", "-m", "torchtitan.train", "-x"]) == (
        "torchtitan.train",
        ("-x",),
        True,
    )
    with pytest.raises(InputError, match="-X is not applied"):
        parse_command(["python", "-X", "dev", "train.py"])


def test_run_with_the_interpreter_runs_the_script(capsys):
    assert main(["run", "--target", "cpu", "--", "python", str(PROGRAMS / "raises.py")]) == 1
    assert 'raise ValueError("learning rate schedule is empty")' in capsys.readouterr().err


@pytest.mark.parametrize("name", ["ddp_torchrun", "fsdp2_torchrun"])
def test_every_rank_sees_cuda_tensors(name, capsys):
    """Each traced rank of a world of two is told its tensors are CUDA tensors, as one rank is
    (DDP and FSDP2 on the fake process group: the same peaks as with CPU-reporting tensors)."""
    spec = ProgramSpec(program=str(PROGRAMS / f"{name}.py"), nproc_per_node=2, max_steps=2)
    report = run_program(spec, gpu="h100-80gb")
    capsys.readouterr()
    assert any(n.startswith("GPU code paths: the program and its libraries") for n in report.notes)


def test_a_program_that_picks_its_device_with_torch_accelerator(capsys):
    """PyTorch's examples choose ``torch.accelerator.current_accelerator()``: under `run` the
    accelerator is the emulated GPU, its memory functions answer from the prediction, and
    --target cpu equals the plain run's count (issue 33: it trained on the CPU, unseen)."""
    on_gpu = run_program(_spec("accelerator_device"), gpu="h100-80gb")
    out = capsys.readouterr().out
    assert "device: cuda 1" in out
    assert f"accelerator peak bytes: {on_gpu.windows[0].peak_bytes}" in out
    predicted = run_program(_spec("accelerator_device"), target="cpu")
    measured = measure_program(_spec("accelerator_device"))
    capsys.readouterr()
    assert predicted.step_peaks == measured.step_peaks


def test_a_failure_in_vramledgers_emulation_is_vramledgers(monkeypatch):
    """The plain run maps CUDA onto the CPU with the same ``torch.cuda`` answers as the trace: a
    missing method of an emulated object fails both runs alike, and is not the program's."""
    from vramledger.trace.emulation import cuda_api

    monkeypatch.delattr(cuda_api.EmulatedStream, "is_capturing")
    with pytest.raises(TraceFailed, match="failed the same way in vramledger's code"):
        run_program_checked(_spec("accelerator_device"), gpu="h100-80gb")


DATA_PARALLEL_HOST_INPUT = 32 * 128 * 4
"""data_parallel.py's host input, ``torch.randn(32, 128)`` in fp32."""


def test_data_parallel_on_one_gpu(capsys):
    """``nn.DataParallel(model).cuda()`` (issue 33: its device check and ``torch._C._scatter``
    failed): with one GPU it scatters the host input onto it and runs the module; --target cpu
    is the plain run's count in every step but the first, where the plain run's peak also holds
    the host input (32 x 128 fp32, named among the host tensors): a GPU run frees its device copy
    after the backward, the CPU run's "copy" is the input itself."""
    on_gpu = run_program(_spec("data_parallel"), gpu="h100-80gb")
    assert f"data parallel peak bytes: {on_gpu.windows[0].peak_bytes}" in capsys.readouterr().out
    predicted = run_program(_spec("data_parallel"), target="cpu")
    measured = measure_program(_spec("data_parallel"))
    capsys.readouterr()
    host = DATA_PARALLEL_HOST_INPUT
    assert predicted.to_dict()["host_bytes"] == host
    assert measured.step_peaks[1] - predicted.step_peaks[1] == host
    assert {k: v for k, v in predicted.step_peaks.items() if k > 1} == {
        k: v for k, v in measured.step_peaks.items() if k > 1
    }


def test_a_checkpoint_saved_and_loaded_back(tmp_path, capsys):
    """Saves write nothing; a ``torch.load`` of what the run saved (issue 33: an empty file,
    ``EOFError``) gets new tensors of the saved layout on the device asked: --target cpu equals
    the plain run's count, and the file is left as the program's ``open`` left it."""
    spec = _spec("save_and_load", args=(str(tmp_path / "best.pt"),))
    on_gpu = run_program(spec, gpu="h100-80gb")
    assert f"save and load peak bytes: {on_gpu.windows[0].peak_bytes}" in capsys.readouterr().out
    assert any("torch.save at save_and_load.py:" in n for n in on_gpu.notes)
    predicted = run_program(spec, target="cpu")
    measured = measure_program(spec)
    capsys.readouterr()
    assert predicted.step_peaks == measured.step_peaks
    assert (tmp_path / "best.pt").stat().st_size == 0


def test_a_loaded_copy_has_the_storages_torch_load_restores():
    """What a real ``torch.load`` allocates for a saved optimizer and model state (views of one
    storage included) is what ``fresh_copy`` allocates: the same storages, sizes and sharing."""
    import io

    import torch
    from torch import nn

    from vramledger.inputs.saved_objects import fresh_copy

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    base = torch.arange(64.0)
    state = {"model": model.state_dict(), "opt": optimizer.state_dict(), "views": [base[:8], base]}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)

    def storages(obj) -> list[tuple[int, int]]:
        leaves = torch.utils._pytree.tree_leaves(obj)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        first: dict[int, int] = {}
        for i, t in enumerate(tensors):
            first.setdefault(t.untyped_storage().data_ptr(), i)
        return [
            (t.untyped_storage().nbytes(), first[t.untyped_storage().data_ptr()]) for t in tensors
        ]

    assert storages(fresh_copy(state)) == storages(torch.load(buffer))


HOST_MODEL_BYTES = (256 * 256 + 256 + 256 * 4 + 4) * 4
"""trains_on_host.py's fp32 parameters."""


def test_a_program_that_trains_on_the_host_is_told_loudly(capsys):
    """Issue 33: a program that trained on the CPU got a clean answer counting only its
    optimizer's state, exit 0. Now the answer says so, on the standard error too, and exits 4
    unless --allow-host-training; the same program on "cuda" is answered as ever."""
    program = str(PROGRAMS / "trains_on_host.py")
    assert main(["run", "--json", "--", program]) == 4
    out = capsys.readouterr()
    assert json.loads(out.out)["trained_on_host_bytes"] == HOST_MODEL_BYTES
    assert f"trained {HOST_MODEL_BYTES:,} bytes of parameters on the CPU" in out.err
    assert main(["run", "--allow-host-training", "--", program]) == 0
    capsys.readouterr()
    assert main(["run", "--json", "--", program, "--device", "cuda"]) == 0
    assert json.loads(capsys.readouterr().out)["trained_on_host_bytes"] == 0


def test_a_launcher_is_said_to_train_in_a_child_process(capsys):
    """A program that starts its training in a child Python process: the answer says that the
    child is not followed, and names its command (``trl sft`` runs ``trl/scripts/sft.py`` so)."""
    report = run_program(_spec("launches_child"), gpu="h100-80gb")
    capsys.readouterr()
    assert report.steps == 0
    [child] = [n for n in report.notes if n.startswith("the program started 1 Python process")]
    assert "child: training would run here" in child
