"""DTensor's sharding-propagation caches across fake process groups (``parallel/fake_group.py``):
kept between groups of the same rank that made no other group, where
they change nothing but time, and emptied otherwise."""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist
from torch.distributed.tensor import _dispatch

from vramledger import TrainingSpec, estimate
from vramledger.inputs.cache import disabled
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
        assert seen  # the first trace propagated every operator's sharding
        estimate(replace(SPEC, world_size=2))  # another world between: its own cache entries
        propagated = len(seen)
        again = estimate(replace(SPEC, batch_size=3))
        other = estimate(replace(SPEC, world_size=2, batch_size=3))
        assert len(seen) == propagated  # both worlds' traces read every sharding from the caches
        fake_group.forget_sharding_propagation()
        cleared = estimate(replace(SPEC, batch_size=3))
        fake_group.forget_sharding_propagation()
        other_cleared = estimate(replace(SPEC, world_size=2, batch_size=3))
    for got, want in ((again, cleared), (other, other_cleared)):
        assert got.timeline.nbytes == want.timeline.nbytes
        assert got.allocated_peak_bytes == want.allocated_peak_bytes
    assert first.allocated_peak_bytes < again.allocated_peak_bytes  # another size: traced


def test_another_rank_or_another_group_empties_them():
    with disabled():
        estimate(SPEC)
    rank0 = fake_group._kept
    assert rank0 == 0
    with fake_world(0, 4):
        assert fake_group._kept == 0  # the same rank: kept
    with fake_world(1, 4):
        assert fake_group._kept is None  # another rank: emptied
    assert fake_group._kept == 1
    with fake_group.fake_process_group(1, 2, group_name="another"):
        # what the rank alone stands for: the default group is named alike in every group
        assert dist.group.WORLD.group_name == "0"
        assert fake_group._kept == 1
    with fake_world(0, 4):
        dist.new_group([0, 1])  # named by a counter: another trace may name another group so
    assert fake_group._kept is None
