"""The model-parallel axes in a plan: tensor parallelism within a node, pipeline stages across
nodes, FSDP2 over the rest (torchtitan's FSDP x TP x PP mesh, ``parallel/mesh.py``).

Starting from an optimizer's data-parallel answer (ZeRO-3/FSDP on ``G`` GPUs, no offload), each
layout ``(tp, pp)`` — ``tp`` dividing the GPUs of a node, ``pp`` at most the nodes — is
re-estimated with the real engines from ``dp = floor((G - 1) / (tp x pp))`` data-parallel ranks,
with the answer's checkpointing and micro-batch, and its ``dp`` moved until it fits and one fewer
replica (``tp x pp`` GPUs fewer: a layout cannot lose a single GPU) does not. Every layout shown is
what ``estimate`` says for it. A pipeline layout runs ``pp`` micro-batches of the answer's
micro-batch (1F1B, its fewest: a batch of ``pp x micro-batch`` per data-parallel rank).

Pipeline layouts are opt-in (``pp_degrees``): a pipeline estimate traces every layer of every
stage (the schedule interleaves the micro-batches, so a stage's trace is not a repeat of one
block and is not extended from a few), about a minute for a 70B model at pp 4 on a 2-core
machine, where a tensor-parallel one is extended from four blocks in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vramledger.inputs.errors import VramledgerError
from vramledger.inputs.spec import TrainingSpec
from vramledger.plan.candidates import RECOMPUTE_FRACTION, RUN_FIELDS, Configuration, planned_spec

VERIFY_TRIES = 4
"""Re-estimates allowed per layout when moving its data-parallel degree."""
TP_DEGREES = (2, 4, 8)
"""Tensor-parallel degrees tried (those dividing the GPUs of a node)."""
ACTIVATION_COLLECTIVES_PER_LAYER = 8
"""Collectives of activations per block and step with sequence parallelism (torchtitan's plan):
two all-gathers and two reduce-scatters in forward, as many in backward, each moving
``(tp - 1) / tp`` of the block's ``s x b x h`` hidden states."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One optimizer's run laid out on a ``dp x tp x pp`` mesh."""

    optimizer: str
    precision: str
    checkpointing: bool
    micro_batch: int
    tp: int
    pp: int
    dp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def spec(self, base: TrainingSpec) -> TrainingSpec:
        """The TrainingSpec ``estimate`` takes for this layout."""
        return planned_spec(
            base,
            self,
            batch_size=self.micro_batch * self.pp,
            grad_accum=1,
            world_size=1,
            dp_shard=self.dp,
            tp=self.tp,
            pp=self.pp,
            microbatches=self.pp if self.pp > 1 else None,
            pp_schedule="1f1b",
            strategy="fsdp" if self.dp > 1 else None,
            offload="none",
        )

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "gpus": self.gpus}


@dataclass(frozen=True, kw_only=True)
class LayoutResult:
    layout: Layout
    peak_bytes_per_gpu: int
    """Reserved by the caching allocator on the worst rank, re-estimated with the real engines."""
    headroom_bytes: int
    fits: bool
    settled: bool
    """One replica fewer was re-estimated and does not fit (or the layout is at one replica)."""
    costs: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.layout.gpus,
            "layout": self.layout.to_dict(),
            "peak_bytes_per_gpu": self.peak_bytes_per_gpu,
            "headroom_bytes": self.headroom_bytes,
            "fits": self.fits,
            "settled": self.settled,
            "costs": self.costs,
            "method": "estimated",
        }


def layout_pairs(
    gpus_per_node: int, max_gpus: int, tp_degrees: Sequence[int], pp_degrees: Sequence[int]
) -> list[tuple[int, int]]:
    """(tp, pp) pairs to try: tp divides a node's GPUs, pp at most the nodes ``max_gpus``
    spans; (1, 1) (plain data parallelism) left out: the plan's own answer."""
    nodes = max(1, max_gpus // gpus_per_node)
    out = []
    for pp in sorted({1, *pp_degrees}):
        if pp > 1 and pp > nodes:
            continue
        for tp in sorted({1, *tp_degrees}):
            if (tp, pp) == (1, 1) or gpus_per_node % tp or tp * pp > max_gpus:
                continue
            out.append((tp, pp))
    return out


def search_layout(
    start: Layout,
    estimated: Callable[[Layout], tuple[int, int]],
    capacity: int,
    max_gpus: int,
) -> LayoutResult | str:
    """Move ``start``'s data-parallel degree until it fits and one replica fewer does not;
    ``estimated(layout)`` is its (reserved peak, host bytes) with the real engines. Returns the
    result, or why the layout cannot run (an engine's refusal, in its words)."""
    known: dict[int, int] = {}

    def peak(dp: int) -> int:
        if dp not in known:
            known[dp] = estimated(replace(start, dp=dp))[0]
        return known[dp]

    def fits(dp: int) -> bool:
        return peak(dp) <= capacity

    top = max(1, max_gpus // (start.tp * start.pp))
    dp = min(start.dp, top)
    try:
        for _ in range(VERIFY_TRIES):
            if not fits(dp):
                if dp >= top:
                    break
                dp += 1
            elif dp == 1 or not fits(dp - 1):
                break
            else:
                dp -= 1
        ok = fits(dp)
    except VramledgerError as exc:
        return exc.message
    layout = replace(start, dp=dp)
    settled = ok and (dp == 1 or (dp - 1 in known and known[dp - 1] > capacity))
    return LayoutResult(
        layout=layout,
        peak_bytes_per_gpu=known[dp],
        headroom_bytes=capacity - known[dp],
        fits=ok,
        settled=settled,
        costs={},
    )


def start_layout(answer: Configuration, tp: int, pp: int) -> Layout:
    """The layout (tp, pp) of a data-parallel answer, at the data-parallel degree that fits
    in one GPU fewer than the answer (rounded down): a layout shards the model state over its
    GPUs as FSDP does and splits the activations too, so it rarely needs as many GPUs (where it
    does, the search moves up; this only decides which count is estimated first)."""
    shared = {name: getattr(answer, name) for name in RUN_FIELDS}
    return Layout(**shared, tp=tp, pp=pp, dp=max(1, (answer.gpus - 1) // (tp * pp)))


def likely_layouts(answer: Configuration, pairs: Sequence[tuple[int, int]]) -> list[Layout]:
    """What the layout searches of ``answer`` most likely re-estimate: each start and one
    replica fewer (to run ahead)."""
    if answer.gpus <= 1:
        return []
    starts = [start_layout(answer, tp, pp) for tp, pp in pairs]
    return [replace(x, dp=dp) for x in starts for dp in (x.dp, x.dp - 1) if dp >= 1]


def layout_costs(
    layout: Layout, seq_len: int, hidden: int, layers: int, parameter_bytes: int
) -> dict[str, Any]:
    """Rough per-step costs besides memory, per GPU: the activations tensor parallelism moves
    (``ACTIVATION_COLLECTIVES_PER_LAYER`` per block of the rank's stage, bf16), FSDP's
    parameter traffic (3x a shard: two all-gathers and a reduce-scatter of the rank's
    ``1 / (tp x pp)`` of the parameters), and the pipeline bubble of 1F1B,
    ``(pp - 1) / (m + pp - 1)`` of the step idle with ``m = pp`` micro-batches."""
    tokens = layout.micro_batch * seq_len * layout.pp  # every micro-batch of the step
    per_block = ACTIVATION_COLLECTIVES_PER_LAYER * tokens * hidden * 2 * (layout.tp - 1)
    return {
        "recompute_fraction": RECOMPUTE_FRACTION if layout.checkpointing else 0.0,
        "tensor_parallel_bytes_per_step": per_block // layout.tp * (layers // layout.pp),
        "fsdp_bytes_per_step": 3 * parameter_bytes // (layout.tp * layout.pp)
        if layout.dp > 1
        else 0,
        "pipeline_bubble_fraction": (layout.pp - 1) / (2 * layout.pp - 1),
    }


def search_layouts(
    answers: dict[str, Configuration | None],
    pairs: Sequence[tuple[int, int]],
    *,
    estimated: Callable[[Layout], tuple[int, int]],
    ahead: Callable[[list[Layout]], None],
    capacity: int,
    max_gpus: int,
    cost: Callable[[Layout], dict[str, Any]],
) -> tuple[dict[str, list[LayoutResult]], list[str]]:
    """Every layout of ``pairs`` for each optimizer's data-parallel answer (``answers``: its
    configuration without offload, or None), re-estimated (``search_layout``); and notes on the
    layouts an engine refused."""
    starts = {
        name: [start_layout(cfg, tp, pp) for tp, pp in pairs]
        for name, cfg in answers.items()
        if cfg is not None and cfg.gpus > 1
    }
    ahead([x for cfg in answers.values() if cfg is not None for x in likely_layouts(cfg, pairs)])
    results: dict[str, list[LayoutResult]] = {}
    notes: list[str] = []
    for name, layouts in starts.items():
        results[name] = []
        for start in layouts:
            found = search_layout(start, estimated, capacity, max_gpus)
            if isinstance(found, str):
                notes.append(f"{name}: tp {start.tp} x pp {start.pp} not estimated: {found}")
                continue
            results[name].append(replace(found, costs=cost(found.layout)))
        results[name].sort(key=lambda r: (not r.fits, r.layout.gpus, r.layout.pp, r.layout.tp))
    return results, notes


def auto_tp_degrees(answers: dict[str, Configuration | None], gpus_per_node: int) -> list[int]:
    """Tensor-parallel degrees searched by default: those of ``TP_DEGREES`` dividing a node,
    when some optimizer's data-parallel answer spans more than one node (tensor parallelism
    within a node is how such runs are laid out); none otherwise."""
    spans = any(cfg is not None and cfg.gpus > gpus_per_node for cfg in answers.values())
    return [t for t in TP_DEGREES if gpus_per_node % t == 0] if spans else []
