"""DTensor's sharding-propagation caches across traces (``parallel/fake_group.py``): kept between
data-parallel traces of the same rank, where they change nothing but time, and emptied for
another rank and by traces that do not keep them."""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist
from torch.distributed.tensor import _dispatch

from vramledger import TrainingSpec, estimate
from vramledger.cache import disabled
from vramledger.parallel import fake_group
from vramledger.parallel.engines import fake_world

from .conftest import fixture

SPEC = TrainingSpec(
    model=fixture("tiny-llama.json"),
    seq_len=32,
    batch_size=2,
    precision="bf16-master",
    world_size=4,
    strategy="fsdp",
)


def _propagations(monkeypatch) -> list[object]:
    """Each operator whose sharding DTensor propagates without its caches."""
    seen: list[object] = []
    slow = _dispatch.OpDispatcher._propagate_op_sharding_dispatch_slow_path

    def counted(self, op_call, *args, **kwargs):
        seen.append(op_call)
        return slow(self, op_call, *args, **kwargs)

    monkeypatch.setattr(
        _dispatch.OpDispatcher, "_propagate_op_sharding_dispatch_slow_path", counted
    )
    return seen


def test_kept_caches_answer_as_emptied_ones(monkeypatch):
    seen = _propagations(monkeypatch)
    with disabled():
        fake_group.forget_sharding_propagation()
        first = estimate(SPEC)
        propagated = len(seen)
        estimate(replace(SPEC, world_size=2))  # another world between: its own cache entries
        again = estimate(replace(SPEC, batch_size=3))
        other = estimate(replace(SPEC, world_size=2, batch_size=3))
        kept = len(seen)
        fake_group.forget_sharding_propagation()
        cleared = estimate(replace(SPEC, batch_size=3))
        fake_group.forget_sharding_propagation()
        other_cleared = estimate(replace(SPEC, world_size=2, batch_size=3))
    assert propagated > 0
    assert kept == 2 * propagated  # the 2-rank world propagated once, then nothing again
    for got, want in ((again, cleared), (other, other_cleared)):
        assert got.timeline.nbytes == want.timeline.nbytes
        assert got.allocated_peak_bytes == want.allocated_peak_bytes
    assert first.allocated_peak_bytes < again.allocated_peak_bytes  # another size: traced


def test_another_rank_or_a_trace_that_does_not_keep_empties_them():
    with disabled():
        estimate(SPEC)
    rank0 = fake_group._kept
    assert rank0 is not None
    with fake_world(1, 4):
        assert fake_group._kept not in (None, rank0)
    with fake_group.fake_process_group(0, 2):  # does not keep: empties them
        assert fake_group._kept is None
    with fake_world(0, 4):
        assert fake_group._kept == rank0
    assert fake_group._kept == rank0  # only the default group: kept
    with fake_world(0, 4):
        dist.new_group([0, 1])  # named by a counter: another trace may name another group so
    assert fake_group._kept is None
