"""`vramledger run --nproc-per-node 2 -- -m torchtitan.train` with torchtitan's debug model
(issue 20), torchtitan 0.2.2 from the ``frameworks`` extra. A tokenizer and data for it are made in
the test's folder (tests/programs/torchtitan_tiny.py): nothing is read from torchtitan's
repository, nothing downloaded.

torchtitan 0.2 (0.2.2 on torch 2.13, with triton installed, which its MoE kernels import as a
CUDA build of PyTorch brings it): the llama3 debug model of its own
``train_configs/debug_model.toml`` (its settings given as flags,
``torchtitan_tiny.DEBUG_MODEL_02``) attends with SDPA (``attn_type="sdpa"``, its default), as
two FSDP2 ranks (dp_shard 2) with bf16 parameters and selective activation checkpointing. Every
rank of the trace is held to its real gloo process within 0.5 %.

Why not torchtitan 0.3 (0.3.0, tried): its language models attend with FlexAttention only
(``get_attention_config`` in torchtitan/models/common/config_utils.py takes flex, flex_flash and
varlen, and refuses sdpa: "sdpa is no longer supported for language models"), and FlexAttention
refuses gradients on the CPU (``_validate_device`` in torch/nn/attention/flex_attention.py:
"FlexAttention does not support backward on CPU"), so the real CPU run stops at the first
attention, and the trace with it; run under ``--parallelism.spmd_backend partial_dtensor`` (the
default ``spmd_types`` backend fails in torch 2.13's ``fully_shard`` in a real run too: "When
dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh") and
``--training.disable_cuda_graphs`` (a CPU-only PyTorch has no ``_graph_pool_handle``). Its
graph_trainer's ``graph_trainer_llama3_debugmodel_sdpa_eager`` config (test-only SDPA) stops
before the model is built on torch 2.13: ``_maybe_apply_numa_binding_to_current_process() got an
unexpected keyword argument 'device_index'`` (torch 2.13 names it ``gpu_index``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vramledger.inputs.program import ProgramSpec
from vramledger.measure.program import measure_program
from vramledger.predict.program import run_program

sys.path.insert(0, str(Path(__file__).parent / "programs"))
import torchtitan_tiny

SMALL = ("--training.steps", "3", "--training.seq_len", "256", "--training.local_batch_size", "2")
ARGS = (*torchtitan_tiny.DEBUG_MODEL_02, *SMALL)
"""torchtitan 0.2: its llama3 debug model config, at a short sequence and a small batch."""


@pytest.fixture
def titan_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a tokenizer for the debug model and a small ``c4_test``."""
    torchtitan_tiny.make(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _spec() -> ProgramSpec:
    return ProgramSpec(
        program="torchtitan.train",
        module=True,
        args=ARGS,
        nproc_per_node=2,
        max_steps=3,
    )


def test_one_step_per_training_step(titan_dir):
    """torchtitan's ``OptimizersContainer`` (an Optimizer whose step steps an AdamW per model
    part) takes one step per training step, and the AdamW's state is optimizer state."""
    report = run_program(_spec(), target="cpu")
    assert report.steps == 3
    assert report.optimizers == ["OptimizersContainer"]
    assert report.ledger is not None and report.ledger.optimizer_state_bytes > 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_rank_within_half_a_percent_of_its_real_gloo_process(titan_dir):
    measured = dict(measure_program(_spec(), quiet=True).ranks)
    predicted = {rank: r for ids, r in run_program(_spec(), target="cpu").ranks for rank in ids}
    assert sorted(measured) == [0, 1]
    for rank, got in measured.items():
        assert abs(got.peak_bytes - predicted[rank].peak_bytes) <= 0.005 * got.peak_bytes
