"""`vramledger run --nproc-per-node 2 -- -m torchtitan.train` with torchtitan's debug model
(issue 20). Skipped where torchtitan is not installed, or where its test tokenizer is not at hand
(the wheel does not ship it: a torchtitan source checkout gives it, ``TORCHTITAN_SOURCE`` naming
the checkout or its bare git directory).

What runs today, on torch 2.13 and torchtitan 0.3.0, under FSDP2 (dp_shard 2) with
``--parallelism.spmd_backend partial_dtensor`` (the default ``spmd_types`` backend fails in
torch 2.13's ``fully_shard`` in a real run too: "When dp_mesh_dims is provided, all parameters
must be DTensors on the full SPMD mesh") and ``--training.disable_cuda_graphs`` (CUDA graph
capture is not emulated; a CPU-only PyTorch has no ``_graph_pool_handle``): the trace builds the
mesh, shards the meta-initialised model, ``to_empty``s it onto the emulated GPU, initialises it,
all-reduces the batch's token count, and stops at the first attention's backward check:
torchtitan's language models attend with FlexAttention only (``get_attention_config``: flex,
flex_flash, varlen), and FlexAttention refuses gradients on the CPU
(``_validate_device`` in torch/nn/attention/flex_attention.py). The real gloo run stops at the
same check, so the per-rank comparison of issue 20 is blocked there (xfail below).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from vramledger.measure_program import measure_program
from vramledger.predict_program import run_program
from vramledger.program import ProgramFailed, ProgramSpec

torchtitan = pytest.importorskip("torchtitan")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_DIR = "tests/assets/tokenizer"
"""Where the debug model's config reads its tokenizer (``hf_assets_path``), relative to the
working directory."""
DATA_DIR = Path("tests/assets/c4_test")
"""The ``c4_test`` dataset's local path (torchtitan's dataset registry)."""
DATA_ROWS = 64
FLEX_ON_CPU = "FlexAttention does not support backward on CPU"

ARGS = (
    "--module",
    "llama3",
    "--config",
    "llama3_debugmodel",
    "--training.steps",
    "3",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "2",
    "--checkpoint.no-enable",
    "--validator.no-enable",
    "--parallelism.spmd_backend",
    "partial_dtensor",
    "--training.disable_cuda_graphs",
)


def _tokenizer_file(name: str) -> bytes | None:
    """One of the test tokenizer's files: from a source install's checkout, else from
    ``TORCHTITAN_SOURCE`` (a checkout, or a bare git directory read at HEAD)."""
    checkout = Path(torchtitan.__file__).resolve().parents[1]
    candidates = [checkout]
    source = os.environ.get("TORCHTITAN_SOURCE")
    if source:
        candidates.append(Path(source))
    for root in candidates:
        path = root / TOKENIZER_DIR / name
        if path.is_file():
            return path.read_bytes()
        if (root / "HEAD").is_file():  # a bare git directory
            shown = subprocess.run(
                ["git", "--git-dir", str(root), "show", f"HEAD:{TOKENIZER_DIR}/{name}"],
                capture_output=True,
                check=False,
            )
            if shown.returncode == 0:
                return shown.stdout
    return None


@pytest.fixture
def titan_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with the debug model's tokenizer and a small local ``c4_test``."""
    for name in TOKENIZER_FILES:
        data = _tokenizer_file(name)
        if data is None:
            pytest.skip("torchtitan's test tokenizer is not at hand (set TORCHTITAN_SOURCE)")
        (tmp_path / TOKENIZER_DIR).mkdir(parents=True, exist_ok=True)
        (tmp_path / TOKENIZER_DIR / name).write_bytes(data)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "his",
        "he",
        "it",
        "an",
        "are",
    ]
    (tmp_path / DATA_DIR).mkdir(parents=True)
    with open(tmp_path / DATA_DIR / "data.json", "w") as f:
        for row in range(DATA_ROWS):
            text = " ".join(words[(row * 7 + i) % len(words)] for i in range(400))
            f.write(json.dumps({"text": text}) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _spec() -> ProgramSpec:
    return ProgramSpec(
        program="torchtitan.train", module=True, args=ARGS, nproc_per_node=2, max_steps=3
    )


def test_trace_runs_to_flex_attention_backward(titan_dir):
    """Mesh, FSDP2 sharding, ``to_empty`` of DTensor parameters onto the emulated GPU, their
    initialisation (DTensor random ops, ``trunc_normal_``'s value reads) and the token count's
    all-reduce all run; the trace stops where the real CPU run stops."""
    with pytest.raises(ProgramFailed, match=FLEX_ON_CPU) as failed:
        run_program(_spec(), target="cpu")
    assert failed.value.steps == 0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.xfail(
    raises=ProgramFailed, strict=True, reason=f"blocked: the real CPU run raises {FLEX_ON_CPU}"
)
def test_every_rank_equals_its_real_gloo_process(titan_dir):
    measured = dict(measure_program(_spec(), quiet=True).ranks)
    predicted = {rank: r for ids, r in run_program(_spec(), target="cpu").ranks for rank in ids}
    for rank, got in measured.items():
        assert abs(got.peak_bytes - predicted[rank].peak_bytes) <= 0.005 * got.peak_bytes
