"""Pipeline parallelism (``parallel/pipeline.py``): stages cut as torchtitan cuts them, run by
``torch.distributed.pipelining``'s own schedules on a fake process group, and the same stages
and schedules on real gloo processes, each rank's prediction compared with the CPU allocator's
own count (``cpu_allocator_count``, every thread; ``tests/mesh_real.py``)."""

import json
import os

import pytest

from vramledger import TrainingSpec, estimate
from vramledger.inputs.categories import Category
from vramledger.inputs.errors import InputError
from vramledger.parallel.pipeline import rank_stage_plans, stage_layers

from .conftest import FIXTURES
from .mesh_real import PIPELINE, check_against_real_runs

LLAMA8 = str(FIXTURES / "hub" / "tiny-llama-8l-bf16")  # 8 layers
TEXT_OPTIONS = dict(seq_len=32, target="cpu", precision="bf16-master")
TEXT = dict(model=LLAMA8, **TEXT_OPTIONS)


def test_stages_are_cut_as_torchtitan_cuts_them():
    # embedding and head weigh one layer each: 8 + 2 = 10 over 2 stages -> 4 + 4 layers
    assert stage_layers(2, 8) == [range(0, 4), range(4, 8)]
    # 10 over 4: 3, 3, 2, 2 (remainder to the first), minus the embedding and the head
    assert stage_layers(4, 8) == [range(0, 2), range(2, 5), range(5, 7), range(7, 8)]
    with pytest.raises(InputError, match="pipeline stages need"):
        stage_layers(8, 2)
    # interleaved 1F1B: two stages per rank, the looped placement (r, r + pp)
    spec = TrainingSpec(pp=2, pp_schedule="interleaved-1f1b", microbatches=4, **TEXT)
    assert [p.index for p in rank_stage_plans(spec, 1, 8)] == [1, 3]


def test_every_pipeline_rank_has_its_ledger_and_coordinates():
    ledger = estimate(pp=2, dp_shard=2, microbatches=2, batch_size=2, **TEXT)
    data = ledger.to_dict()
    assert [r["rank_ids"] for r in data["ranks"]] == [[0, 1], [2, 3]]
    assert [r["mesh_coords"]["pp"] for r in data["ranks"]] == [0, 1]
    assert [r["mesh_coords"]["dp"] for r in data["ranks"]] == [0, 0]
    first = ledger.ranks[0][1]
    assert first.at_peak.get(Category.PIPELINE_BUFFERS, 0) > 0  # gradients from stage 1
    assert any("Schedule1F1B" in n for n in first.notes)
    assert ledger.worst_rank in (0, 2)


def test_gpipe_keeps_every_micro_batch_in_flight_and_1f1b_does_not():
    """The schedule's own order decides the activations in flight: GPipe runs all forwards
    before any backward; 1F1B lets the first of 2 stages run 2 forwards ahead, the last 1."""
    spec = dict(pp=2, microbatches=8, batch_size=8, **TEXT)
    gpipe = estimate(pp_schedule="gpipe", **spec)
    one = estimate(pp_schedule="1f1b", **spec)
    activations = {
        name: [r.at_peak.get(Category.ACTIVATIONS, 0) for _, r in ledger.ranks]
        for name, ledger in (("gpipe", gpipe), ("1f1b", one))
    }
    for stage in (0, 1):
        assert activations["1f1b"][stage] * 3 < activations["gpipe"][stage], activations


def test_parameters_are_the_whole_models_and_each_stage_says_its_own(capsys):
    """Issue 32: with --pp 2 the summary counted one stage's parameters and divided the
    optimizer state over all ranks by them (16 bytes/parameter for AdamW). tiny-llama.json by
    hand: embedding and head 1000 x 64 each, final norm 64; a layer 4 x 64 x 16 x (4 + 2 + 2 + 4)
    = 12,288 for attention (4 query heads, 2 key/value heads of 16), 3 x 64 x 176 = 33,792 for
    the MLP, 2 x 64 for its norms: 46,208. Stage 0: the embedding and layer 0; stage 1: layer 1,
    the norm and the head."""
    from .test_cli import run_cli

    layer = 64 * 16 * (4 + 2 + 2 + 4) + 3 * 64 * 176 + 2 * 64
    stages = [64_000 + layer, layer + 64 + 64_000]
    args = ["estimate", str(FIXTURES / "tiny-llama.json"), "--seq-len", "32", "--pp", "2"]
    code, out, _ = run_cli(capsys, *args, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["parameters"] == data["trainable_parameters"] == sum(stages) == 220_480
    assert [r["stage_parameters"] for r in data["ranks"]] == stages
    assert all(r["parameters"] == sum(stages) for r in data["ranks"])
    # AdamW's m and v: 8 bytes per parameter of the whole model over both stages (and a 4-byte
    # step counter per parameter tensor)
    assert 0 <= data["optimizer_state_bytes_all_ranks"] - 8 * sum(stages) < 1024
    _, out, _ = run_cli(capsys, *args)
    lines = {line.split(":")[0]: line for line in out.splitlines() if ":" in line}
    worst = data["worst_rank"]
    assert lines["parameters"] == (
        f"parameters: 220,480 (220,480 trainable); rank {worst} holds "
        f"{stages[worst]:,} of them (pipeline stages split the layers over ranks)"
    )
    assert "(4.00 bytes per trainable parameter of the whole model)" in lines["optimizer state"]
    assert "over all 2 ranks (8.00 bytes/parameter)" in lines["optimizer state"]


def test_stages_with_tensor_parallelism_and_fsdp_have_a_ledger_per_pipeline_rank():
    """The issue's shape (--dp-shard x --tp x --pp, 1F1B, --cp 1) at small scale, estimate
    only: one ledger per pipeline rank (the tp and dp ranks of a stage are symmetric), each
    with its mesh coordinates, the hidden states between stages split over the sequence."""
    ledger = estimate(
        pp=2, tp=2, dp_shard=2, cp=1, pp_schedule="1f1b", microbatches=2, batch_size=2, **TEXT
    )
    data = ledger.to_dict()
    assert data["world_size"] == 8
    assert [r["rank_ids"] for r in data["ranks"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["mesh_coords"] for r in data["ranks"]] == [
        {"dp": 0, "tp": 0, "pp": p, "cp": 0, "ep": 0} for p in (0, 1)
    ]
    first, last = (r for _, r in ledger.ranks)
    assert first.peak_bytes != last.peak_bytes
    assert ledger.worst_rank in (0, 4)
    for rank in (first, last):
        assert any("tensor parallel over 2 ranks" in n for n in rank.notes)
        assert any("part of the sequence" in n for n in rank.notes)
        assert any("FSDP2 fully_shard over the 2 data-parallel ranks" in n for n in rank.notes)
        assert rank.at_peak.get(Category.PIPELINE_BUFFERS, 0) > 0


def test_what_the_pipeline_engine_does_not_model_is_refused():
    with pytest.raises(InputError, match="with context parallelism is not modelled yet"):
        estimate(pp=2, cp=2, batch_size=2, **TEXT)
    with pytest.raises(InputError, match="splits the sequence"):
        estimate(pp=2, tp=2, batch_size=2, **{**TEXT, "seq_len": 31})
    with pytest.raises(InputError, match="micro-batches as stages"):
        estimate(pp=4, microbatches=2, batch_size=2, **TEXT)
    with pytest.raises(InputError, match="the micro-batches are the accumulation"):
        estimate(pp=2, grad_accum=2, batch_size=2, **TEXT)


# -- against real processes -------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_prediction_matches_real_pipeline_runs(world):
    """GPipe, 1F1B and interleaved 1F1B on 2 processes; 1F1B over 4 stages, 2 stages x FSDP2
    over 2 data-parallel ranks, and 2 stages x tensor parallel over 2 ranks, on 4."""
    check_against_real_runs(world, PIPELINE[world])


@pytest.mark.slow
def test_every_stage_extends_its_blocks_in_a_fresh_process_and_equals_its_full_trace():
    """Each stage of a 40-layer model traces 4 and 5 of its 20 blocks and extends them, rank 0
    too: in a fresh interpreter, where torch.distributed.pipelining is first imported by the
    estimate (its microbatch.py makes a tensor at import, which fell inside the first stage's
    4-block trace only, and stage 0 was traced in full). Each rank's peak equals its full
    trace's."""
    import subprocess
    import sys

    from vramledger.ledger.replay import replay, steady_peak
    from vramledger.parallel.pipeline import PipelineParallel
    from vramledger.predict.step import policy_for
    from vramledger.trace.core.fake import trace

    spec = TrainingSpec(model=str(FIXTURES / "tiny-llama-40l.json"), pp=2, **TEXT_OPTIONS)
    code = (
        "import json, sys; from vramledger import estimate; "
        f"l = estimate(model={spec.model!r}, pp=2, **{TEXT_OPTIONS!r}); "
        "print(json.dumps([[ids, r.peak_bytes, any('extended the timeline' in n for n in r.notes)]"
        " for ids, r in l.ranks]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "VRAMLEDGER_NO_CACHE": "1"},
    )
    ranks = json.loads(done.stdout.splitlines()[-1])
    assert [ids for ids, _, _ in ranks] == [[0], [1]]
    assert all(extended for _, _, extended in ranks), ranks
    for (ids, peak, _), rank in zip(ranks, (0, 1), strict=True):
        full = trace(
            spec,
            policy_for(spec),
            rank=rank,
            extend_blocks=False,
            engine=PipelineParallel(spec, rank),
        )
        assert steady_peak(replay(full.timeline)).total == peak, ids
