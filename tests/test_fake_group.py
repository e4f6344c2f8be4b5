"""DTensor's sharding-propagation caches across traces (``parallel/fake_group.py``): kept between
traces of the same rank of the same data-parallel world, where they change nothing but time, and
emptied for any other world."""

from __future__ import annotations

from dataclasses import replace

from torch.distributed.tensor import _dispatch

from vramledger import TrainingSpec, estimate
from vramledger.cache import disabled
from vramledger.parallel import fake_group

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


def test_traces_of_one_world_keep_the_caches_and_answer_the_same(monkeypatch):
    seen = _propagations(monkeypatch)
    with disabled():
        fake_group.forget_sharding_propagation()
        first = estimate(SPEC)
        propagated = len(seen)
        again = estimate(replace(SPEC, batch_size=3))
        kept = len(seen) - propagated
        fake_group.forget_sharding_propagation()
        cleared = estimate(replace(SPEC, batch_size=3))
    assert propagated > 0
    assert kept == 0  # every operator's sharding was in the caches
    assert again.timeline.nbytes == cleared.timeline.nbytes
    assert again.allocated_peak_bytes == cleared.allocated_peak_bytes
    assert first.allocated_peak_bytes < again.allocated_peak_bytes  # another size: traced


def test_another_world_or_a_world_that_does_not_keep_empties_them(monkeypatch):
    seen = _propagations(monkeypatch)
    with disabled():
        estimate(SPEC)
        world = fake_group._kept
        assert world is not None
        before = len(seen)
        estimate(replace(SPEC, world_size=2))  # another world: propagated again
        assert len(seen) > before
        assert fake_group._kept != world
        with fake_group.fake_process_group(0, 2):  # does not keep: empties them
            pass
        assert fake_group._kept is None
