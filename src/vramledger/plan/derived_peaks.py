"""A configuration's peaks derived from one trace at any GPU count (``derive.py``), the model's
facts the derivation needs, and the fewest GPUs under a capacity (bisection: memory per GPU
never grows with the count)."""

from __future__ import annotations

from collections.abc import Callable

from vramledger.inputs.parallelism import Parallelism
from vramledger.inputs.recipe import resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.ledger.replay import steady_peaks, steady_tensor_peak
from vramledger.plan.derive import DerivedLayout, ModelFacts, derive, derive_layout
from vramledger.record.allocator import CUDA_CACHING_ALLOCATOR
from vramledger.record.event_totals import EventTotals
from vramledger.record.timeline import Timeline
from vramledger.trace.core.blocks import find_block_stack


def model_facts(spec: TrainingSpec) -> ModelFacts:
    recipe = resolve(spec)
    model = recipe.build_model("meta")
    params = [p for p in model.parameters() if p.requires_grad]
    stack = find_block_stack(model, min_blocks=1)
    total = sum(p.numel() for p in params)
    block = (
        sum(p.numel() for p in model.get_submodule(stack.fqn)[0].parameters())
        if stack is not None
        else total
    )
    return ModelFacts(
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        parameter_itemsize=params[0].element_size() if params else 2,
        trainable_parameters=total,
        block_parameters=block,
        root_parameters=total - block * stack.length if stack is not None else 0,
    )


class DerivedPeaks:
    """Derived peaks of one configuration at any GPU count (memoised): the bytes the caching
    allocator reserves (what re-estimates check), the tensor bytes (a cheaper lower bound) and
    the host bytes per rank."""

    def __init__(self, timeline: Timeline, facts: ModelFacts, strategy: str, offload: str):
        self.facts = facts
        self._base = timeline
        self._strategy, self._offload = strategy, offload
        self._layout: tuple[DerivedLayout, EventTotals] | None = None
        self._tensors: dict[int, int] = {}
        self._reserved: dict[int, int] = {}
        self._host: dict[int, int] = {}

    def _derive(self, n: int) -> tuple[Timeline, EventTotals | None]:
        """The derived timeline at ``n`` GPUs, and its events' totals when they are shared by
        every count (rank-independent strategies: derived once, resized per count)."""
        if not Parallelism(strategy=self._strategy).rank_independent:
            return derive(self._base, self.facts, self._strategy, n, self._offload), None
        if self._layout is None:
            layout = derive_layout(self._base, self.facts, self._strategy, self._offload)
            self._layout = layout, EventTotals(layout.timeline)
        layout, totals = self._layout
        return layout.at(n), totals

    def tensors(self, n: int) -> int:
        if n not in self._tensors:
            self._tensors[n] = steady_tensor_peak(*self._derive(n))
        return self._tensors[n]

    def reserved(self, n: int) -> int:
        if n not in self._reserved:
            timeline, totals = self._derive(n)
            peaks = steady_peaks(timeline, CUDA_CACHING_ALLOCATOR, totals)
            self._reserved[n] = peaks.reserved
            self._host[n] = peaks.host
        return self._reserved[n]

    def host(self, n: int) -> int:
        self.reserved(n)
        return self._host[n]


def fewest(
    peak: Callable[[int], int],
    capacity: int,
    lo: int,
    hi: int,
    lower_bound: Callable[[int], int] | None = None,
) -> int | None:
    """Smallest n in [lo, hi] with peak(n) <= capacity (peak never grows with n).

    ``lower_bound`` (never above ``peak``, cheaper) is searched first: the answer is at least
    its answer, and is looked for upward from there in doubling steps, then bisected."""
    if lower_bound is not None:
        start = fewest(lower_bound, capacity, lo, hi)
        if start is None:
            return None
        if peak(start) <= capacity:
            return start
        known_over, step = start, 1
        while True:
            probe = min(known_over + step, hi)
            if peak(probe) <= capacity:
                lo, hi = known_over + 1, probe
                break
            if probe == hi:
                return None
            known_over, step = probe, 2 * step
    elif peak(hi) > capacity:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if peak(mid) <= capacity:
            hi = mid
        else:
            lo = mid + 1
    return lo
