"""`vramledger run --nproc-per-node 2` on programs that set up tensor parallelism
(`parallelize_module` on an `init_device_mesh` mesh, tests/programs/tp_torchrun.py, as PyTorch's
TP tutorial writes it) and pipelining (`PipelineStage` + `ScheduleGPipe`/`Schedule1F1B`,
tests/programs/pp_torchrun.py, as the pipelining tutorial writes it), each rank checked against
the same program run for real on 2 local gloo processes (`run --measure`), with the bound of
tests/test_run_ranks.py: `EXACT_BYTES` per rank, widened by gloo's window
(tests/gloo_noise.py) where the rank has a transient collective (tensor parallelism's
`comm_buffers`); the pipeline's stages have none and keep the exact bound (docs/test-bounds.md).
"""

from __future__ import annotations

import functools

import pytest

from vramledger.inputs.categories import Category
from vramledger.predict.program import ProgramReport, run_program

from .gloo_noise import largest_transient_collective
from .test_run_ranks import _per_rank, _spec, assert_every_rank_equals_its_real_process

TP_PARAMETERS = 492_160
"""tp_torchrun.py's model: embedding 256 x 128, two blocks of (two norms of 128, four 128 x 128
attention projections, three 128 x 384 feed-forward ones), a norm of 128 and a 128 x 256
output: 32,768 + 2 x 213,248 + 128 + 32,768."""


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("tp_torchrun", []),
        ("pp_torchrun", []),
        ("pp_torchrun", ["--schedule", "1f1b", "--shapes", "given"]),
    ],
    ids=["tp", "pp-gpipe-inferred", "pp-1f1b-given"],
)
def test_every_rank_equals_its_real_gloo_process(name, args):
    """Each rank's steady window and steady steps: --target cpu vs the rank's real process."""
    assert_every_rank_equals_its_real_process(_spec(name, args=tuple(args), nproc_per_node=2))


def test_tensor_parallel_program_is_tp():
    """The strategy says 'tp', each parameter is counted once at its global size (the
    DTensor replaced the module's own), the activation collectives are comm_buffers, and the
    note names the styles the program applied; both ranks hold the same."""
    report = run_program(_spec("tp_torchrun", nproc_per_node=2), target="cpu")
    data = report.to_dict()
    assert data["strategy"] == "tp" and data["world_size"] == 2
    assert data["parameters"] == data["trainable_parameters"] == TP_PARAMETERS
    assert [r["rank_ids"] for r in data["ranks"]] == [[0, 1]]
    ledger = report.ledger
    assert ledger is not None and ledger.timeline is not None
    assert Category.COMM_BUFFERS in ledger.timeline.tags
    assert largest_transient_collective(ledger) > 0
    note = next(n for n in data["notes"] if n.startswith("tensor parallelism"))
    for style in ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput"):
        assert style in note
    assert "2-rank device mesh" in note


@functools.cache
def _pipeline_inferred() -> ProgramReport:
    """``run --nproc-per-node 2 --target cpu`` of pp_torchrun.py as written (no rank gives
    shapes), made once for the two tests below that read it (the report is not changed)."""
    return run_program(_spec("pp_torchrun", nproc_per_node=2), target="cpu")


def test_pipeline_program_gives_each_stage_its_ledger():
    """Two stages, two ledgers: each rank's receive buffers are pipeline_buffers, the strategy
    says 'pp', and the notes say how the stages learnt their shapes (inferred: sent from the
    previous stage's trace)."""
    report = _pipeline_inferred()
    data = report.to_dict()
    assert data["strategy"] == "pp"
    assert [r["rank_ids"] for r in data["ranks"]] == [[0], [1]]
    for rank, ledger in report.ledger.ranks:
        assert ledger.timeline is not None
        assert Category.PIPELINE_BUFFERS in ledger.timeline.tags, rank
    per_rank = _per_rank(report)
    for rank in (0, 1):
        note = next(n for n in per_rank[rank].notes if n.startswith("pipelining"))
        assert f"ScheduleGPipe ran stage {rank} of 2" in note and "(DYNAMIC)" in note
        assert "4 micro-batches" in note


def test_pipeline_vote_changed_by_a_later_rank_is_retraced():
    """Rank 0 builds its stage with its shapes and votes STATIC; rank 1 infers its shapes and
    votes DYNAMIC, so every stage runs DYNAMIC (the schedule's vote). Rank 0, traced first,
    assumed STATIC: it is traced again, and its figures are those of the run where no rank
    gave shapes."""
    mixed = _per_rank(
        run_program(
            _spec("pp_torchrun", args=("--shapes", "given-on-rank-0"), nproc_per_node=2),
            target="cpu",
        )
    )
    inferred = _per_rank(_pipeline_inferred())
    for rank in (0, 1):
        note = next(n for n in mixed[rank].notes if n.startswith("pipelining"))
        assert "(DYNAMIC)" in note, rank
        assert mixed[rank].step_peaks == inferred[rank].step_peaks, rank
