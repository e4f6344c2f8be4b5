"""``plan``: the fewest GPUs of a kind on which a training run fits, per optimizer, and the
trade-offs around it — every configuration shown agreeing with ``estimate``.

The search covers optimizer, precision, activation checkpointing, micro-batch (halving it and
accumulating gradients keeps the batch), strategy (DDP, ZeRO-1/2/3), optimizer offload and GPU
count. One fake-tensor trace is made per (optimizer, precision, checkpointing, micro-batch) on
one GPU; strategies and GPU counts are derived from it (``derive.py``: the bytes the caching
allocator reserves, as re-estimates report them) and the smallest GPU count of each
configuration found by bisection (memory per GPU never grows with the count), on the cheaper
tensor bytes first.

Then every configuration the plan shows is re-estimated with the real engines (``runner.py``
memoises them and runs them in worker processes): each optimizer's answer (with and without
offload) at its count and one fewer, moved until it fits and one fewer does not; and the Pareto
front, recomputed from re-estimated configurations until every one on it is re-estimated (within
``FRONT_ESTIMATES``; what remains derived is marked so, with the derivation error this plan
measured). The fewest-GPU answers are the front's best for each optimizer, so the two tables
agree. An answer that fits with little headroom says how much a checkpointed variant would have.

A configuration fits when its peak plus ``margin`` is at most the GPU's memory and, when it
offloads and ``host_memory`` is given, its host bytes per node (each rank's, times the ranks on
a node) are at most ``host_memory``. The margin is explicit: the CUDA context and libraries
(several hundred MiB), allocator fragmentation beyond the modelled caching allocator, and
communication buffers (NCCL) are not in the trace.

This module is the search (``plan``); a configuration's derived peaks and the bisection over
GPU counts are ``derived_peaks.py``, the plan's state (candidates, re-estimates, answers, front)
``planner.py``, and its answer ``result.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from vramledger.inputs.config_depth import config_depth
from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import Gpu
from vramledger.inputs.launch_configs import apply_configs
from vramledger.inputs.notes import Topic, tagged
from vramledger.inputs.optimizers import resolve_optimizer
from vramledger.inputs.recipe import resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.verdict import DEFAULT_MARGIN, MARGIN_SOURCE, check_margin
from vramledger.plan.candidates import (
    DEFAULT_GPUS_PER_NODE,
    ESTIMATED,
    PLANNED_OFFLOADS,
    Candidate,
    Configuration,
    pareto,
    preference,
)
from vramledger.plan.derive import ModelFacts
from vramledger.plan.derived_peaks import DerivedPeaks, fewest, model_facts
from vramledger.plan.layouts import (
    Layout,
    LayoutResult,
    auto_tp_degrees,
    layout_costs,
    layout_pairs,
    likely_layouts,
    search_layouts,
)
from vramledger.plan.planner import Planner
from vramledger.plan.result import Plan
from vramledger.plan.runner import Runner
from vramledger.plan.workers import WORKERS_AT_ONCE_PARAMETERS

Progress = Callable[[str, int, int], None]


def _micro_batches(batch: int) -> list[tuple[int, int]]:
    out, micro = [], batch
    while micro >= 1:
        if batch % micro == 0:
            out.append((micro, batch // micro))
        if micro == 1:
            break
        micro //= 2
    return out


def _likely_counts(config: Configuration | None, max_gpus: int) -> list[Configuration]:
    """The re-estimates an answer most likely needs: its derived count and one fewer (an answer
    rests on both; one more is needed only when the derived count does not fit, and run ahead
    it would hold a worker the others need)."""
    if config is None:
        return []
    if not config.parallelism.shards_optimizer_state:  # the count does not change its memory
        return [config]
    counts = (config.gpus, config.gpus - 1)
    return [replace(config, gpus=n) for n in counts if 2 <= n <= max_gpus]


def plan(
    spec: TrainingSpec,
    gpu: Gpu,
    *,
    optimizers: Sequence[str],
    max_gpus: int = 1024,
    margin: int = DEFAULT_MARGIN,
    margin_source: str = MARGIN_SOURCE,
    precisions: Sequence[str] | None = None,
    checkpointing: Sequence[bool] = (False, True),
    offloads: Sequence[str] = PLANNED_OFFLOADS,
    verify: bool = True,
    workers: int | None = None,
    host_memory: int | None = None,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    progress: Progress | None = None,
    tp_degrees: Sequence[int] | None = None,
    pp_degrees: Sequence[int] = (),
) -> Plan:
    """``workers``: processes for the traces after the first and for the re-estimates
    (``runner.py``); None: one per CPU when the first trace takes long enough to repay starting
    them, else none. ``host_memory``: bytes of host memory per node of ``gpus_per_node`` GPUs.
    ``verify=False`` stops after the search: everything is derived (and marked so).
    ``tp_degrees`` / ``pp_degrees``: the model-parallel layouts searched from each optimizer's
    answer without offload (``layouts.py``); ``tp_degrees=None``: 2, 4, 8 when an answer spans
    more than one node of ``gpus_per_node`` GPUs, else none; pipeline layouts only when
    asked."""
    _check(spec, gpu, optimizers, max_gpus, margin, workers, gpus_per_node)
    spec, _ = apply_configs(spec)  # the launch's config files, once: variants keep their values
    # every trace and re-estimate emulates this GPU (its compute capability's CUDA decisions)
    spec = replace(spec, gpu=gpu, gpu_memory=None, margin=margin)
    start = time.perf_counter()
    bases = _bases(spec, optimizers, list(precisions or [spec.precision]), checkpointing)
    fewest_gpus: dict[str, Candidate | None] = {}
    on_gpu: dict[str, Candidate | None] = {}
    with Runner(workers) as runner:
        facts_cache = _first_facts(bases, runner)
        planner = Planner(
            spec=spec,
            gpu=gpu,
            capacity=gpu.memory_bytes - margin,
            max_gpus=max_gpus,
            host_memory=host_memory,
            gpus_per_node=gpus_per_node,
            runner=runner,
            reference=optimizers[0],
        )
        ahead = (lambda best: _ahead(runner, spec, best, max_gpus)) if verify else None
        ranked, traces, configurations = _search(
            bases, planner, optimizers, offloads, facts_cache, progress, ahead
        )
        searched = time.perf_counter()
        if verify:
            front = _settle(
                planner, optimizers, ranked, fewest_gpus, on_gpu, tp_degrees, pp_degrees, progress
            )
            layouts = _layouts(spec, planner, on_gpu, tp_degrees, pp_degrees, facts_cache, progress)
        else:
            front = _derived_answers(planner, optimizers, ranked, fewest_gpus, on_gpu)
            layouts = {}
        return Plan(
            gpu=gpu,
            margin_bytes=margin,
            margin_source=margin_source,
            max_gpus=max_gpus,
            fewest_gpus=fewest_gpus,
            fewest_gpus_without_offload=on_gpu,
            front=front,
            configurations=configurations,
            traces=traces,
            seconds=time.perf_counter() - start,
            search_seconds=searched - start,
            estimates=runner.estimates,
            workers=runner.workers or 1,
            host_memory_bytes=host_memory,
            gpus_per_node=gpus_per_node,
            notes=tagged(dict.fromkeys(planner.notes), Topic.PLAN),
            layouts=layouts,
        )


def _first_facts(bases: list[TrainingSpec], runner: Runner) -> dict[tuple[str, bool], ModelFacts]:
    """The first base's model facts (its trace), keyed by (precision, checkpointing); for a
    model this large the runner's workers start then, their start-up overlapping the traces
    that follow."""
    facts_cache: dict[tuple[str, bool], ModelFacts] = {}
    if bases:
        first = (bases[0].precision, bases[0].grad_checkpointing)
        facts_cache[first] = model_facts(bases[0])
        if facts_cache[first].trainable_parameters >= WORKERS_AT_ONCE_PARAMETERS:
            runner.start_workers()
    return facts_cache


def _check(
    spec: TrainingSpec,
    gpu: Gpu,
    optimizers: Sequence[str],
    max_gpus: int,
    margin: int,
    workers: int | None,
    gpus_per_node: int,
) -> None:
    """Refuse a request ``plan`` cannot answer before any tracing, saying what to change."""
    if max_gpus < 1:
        raise InputError(f"--max-gpus must be at least 1, not {max_gpus}")
    if workers is not None and workers < 1:
        raise InputError(f"--workers must be at least 1, not {workers}")
    if gpus_per_node < 1:
        raise InputError(f"--gpus-per-node must be at least 1, not {gpus_per_node}")
    if not optimizers:
        raise InputError("no optimizers to plan for", hint="pass --optimizers adamw,sgd-momentum")
    for name in optimizers:  # a misspelt name is refused before any tracing
        resolve_optimizer(name, spec.optimizer_kwargs)
    check_margin(gpu, margin)


def _bases(
    spec: TrainingSpec,
    optimizers: Sequence[str],
    precisions: Sequence[str],
    checkpointing: Sequence[bool],
) -> list[TrainingSpec]:
    """The single-GPU runs traced: every optimizer, precision, checkpointing and split of the
    step's examples into micro-batches, on one CUDA GPU with no engine."""
    micro = _micro_batches(spec.batch_size * spec.grad_accum)
    return [
        replace(
            spec,
            optimizer=optimizer,
            precision=precision,
            grad_checkpointing=ckpt,
            batch_size=micro_batch,
            grad_accum=accum,
            world_size=1,
            nodes=None,
            gpus_per_node=None,
            strategy=None,
            offload="none",
            target="cuda",
        )
        for optimizer in optimizers
        for precision in precisions
        for ckpt in checkpointing
        for micro_batch, accum in micro
    ]


def _search(
    bases: list[TrainingSpec],
    planner: Planner,
    optimizers: Sequence[str],
    offloads: Sequence[str],
    facts_cache: dict[tuple[str, bool], ModelFacts],
    progress: Progress | None,
    ahead: Callable[[list[Candidate]], None] | None,
) -> tuple[dict[str, list[Candidate]], int, int]:
    """Trace every base (in the order the runner's traces come) and derive its configurations;
    once all of an optimizer's bases are in, rank its candidates (best first) and hand them to
    ``ahead``. Returns the ranked candidates per optimizer, the traces and the configurations."""
    traces = configurations = 0
    ranked: dict[str, list[Candidate]] = {name: [] for name in optimizers}
    left = {name: sum(b.optimizer == name for b in bases) for name in optimizers}
    for base, timeline in planner.runner.traces(bases):
        key = (base.precision, base.grad_checkpointing)
        if key not in facts_cache:
            facts_cache[key] = model_facts(base)
        traces += 1
        if progress is not None:
            progress("traces", traces, len(bases))
        configurations += planner.add(base, timeline, facts_cache[key], offloads)
        left[base.optimizer] -= 1
        if not left[base.optimizer]:
            name = base.optimizer
            ranked[name] = sorted(
                (c for c in planner.candidates if c.configuration.optimizer == name),
                key=preference,
            )
            if ahead is not None:  # its answers' re-estimates start while the others are derived
                ahead(ranked[name])
    return ranked, traces, configurations


def _ahead(runner: Runner, spec: TrainingSpec, ranked: list[Candidate], max_gpus: int) -> None:
    """Start re-estimating the GPU counts likely to answer for one optimizer (``ranked``: its
    candidates, best first): its best, and its best without offload."""
    plain = [c for c in ranked if not c.configuration.parallelism.offloads]
    runner.ahead(
        (cfg, cfg.spec(spec))
        for best in (ranked[:1], plain[:1])
        for cfg in _likely_counts(best[0].configuration if best else None, max_gpus)
    )


def _derived_answers(
    planner: Planner,
    optimizers: Sequence[str],
    ranked: dict[str, list[Candidate]],
    fewest_gpus: dict[str, Candidate | None],
    on_gpu: dict[str, Candidate | None],
) -> list[Candidate]:
    """With no re-estimates (``verify=False``): each optimizer's best candidates as derived into
    ``fewest_gpus`` and ``on_gpu`` (without offload); returns the derived Pareto front, each
    marked not re-estimated."""
    error = "not re-estimated (--no-verify)"
    for name in optimizers:
        fewest_gpus[name] = ranked[name][0] if ranked[name] else None
        plain = [c for c in ranked[name] if not c.configuration.parallelism.offloads]
        on_gpu[name] = plain[0] if plain else None
    return [replace(c, error=error) for c in pareto(planner.candidates)]


def _settle(
    planner: Planner,
    optimizers: Sequence[str],
    ranked: dict[str, list[Candidate]],
    fewest_gpus: dict[str, Candidate | None],
    on_gpu: dict[str, Candidate | None],
    tp_degrees: Sequence[int] | None,
    pp_degrees: Sequence[int],
    progress: Progress | None,
) -> list[Candidate]:
    """Re-estimate each optimizer's answers (``ranked``: its candidates, best first) into
    ``fewest_gpus`` and ``on_gpu`` (without offload); returns the Pareto front."""
    for name in optimizers:
        if progress is not None:
            progress("re-estimating answers", optimizers.index(name), len(optimizers))
        fewest_gpus[name] = planner.answer(ranked[name])
        on_gpu[name] = planner.answer(
            [c for c in ranked[name] if not c.configuration.parallelism.offloads]
        )
        # its layouts' re-estimates start while the other optimizers are settled
        _layouts_ahead(planner, on_gpu[name], tp_degrees, pp_degrees)
    front = planner.front()
    # the answers are the front's best per optimizer: the tables agree
    for table in (fewest_gpus, on_gpu):
        for name in table:
            better = [
                c
                for c in planner.current()
                if c.configuration.optimizer == name
                and c.method == ESTIMATED
                and (table is fewest_gpus or not c.configuration.parallelism.offloads)
            ]
            if better:
                table[name] = min(better, key=preference)
    planner.notes += [
        note for note in (planner.roomier(c) for c in fewest_gpus.values() if c) if note
    ]
    return front


def _layouts_ahead(
    planner: Planner,
    answer: Candidate | None,
    tp_degrees: Sequence[int] | None,
    pp_degrees: Sequence[int],
) -> None:
    """Run ahead the layout re-estimates one optimizer's answer without offload will most likely
    need (``_layouts`` searches them once every answer is settled)."""
    cfg = answer.configuration if answer is not None else None
    if cfg is None:
        return
    pairs = _layout_pairs(planner, {"": cfg}, tp_degrees, pp_degrees)
    planner.runner.ahead((x, x.spec(planner.spec)) for x in likely_layouts(cfg, pairs))


def _layout_pairs(
    planner: Planner,
    configs: dict[str, Configuration | None],
    tp_degrees: Sequence[int] | None,
    pp_degrees: Sequence[int],
) -> list[tuple[int, int]]:
    """The (tp, pp) layouts searched for these answers (tensor-parallel degrees by default when
    one spans more than a node, ``auto_tp_degrees``)."""
    tps = auto_tp_degrees(configs, planner.gpus_per_node) if tp_degrees is None else tp_degrees
    return layout_pairs(planner.gpus_per_node, planner.max_gpus, tps, pp_degrees)


def _layouts(
    spec: TrainingSpec,
    planner: Planner,
    answers: dict[str, Candidate | None],
    tp_degrees: Sequence[int] | None,
    pp_degrees: Sequence[int],
    facts_cache: dict[tuple[str, bool], ModelFacts],
    progress: Progress | None,
) -> dict[str, list[LayoutResult]]:
    """The model-parallel layouts of each answer without offload (``layouts.py``), every one
    re-estimated through the plan's runner."""
    configs = {k: (c.configuration if c else None) for k, c in answers.items()}
    pairs = _layout_pairs(planner, configs, tp_degrees, pp_degrees)
    if not pairs or not any(c is not None and c.gpus > 1 for c in configs.values()):
        return {}
    if progress is not None:
        progress("model-parallel layouts", 0, 1)
    config = resolve(spec).source.config
    text = config.get_text_config() if config is not None else None
    hidden = getattr(text, "hidden_size", 0) or 0
    layers = config_depth(config) or 1

    def estimated(layout: Layout) -> tuple[int, int]:
        return planner.runner.reserved(layout, layout.spec(planner.spec))

    results, notes = search_layouts(
        configs,
        pairs,
        estimated=estimated,
        ahead=lambda items: planner.runner.ahead((x, x.spec(planner.spec)) for x in items),
        capacity=planner.capacity,
        max_gpus=planner.max_gpus,
        cost=lambda x: layout_costs(
            x,
            spec.seq_len,
            hidden,
            layers,
            facts_cache[(x.precision, x.checkpointing)].parameter_bytes,
        ),
    )
    planner.notes += notes
    for name, found in results.items():
        best = next((r for r in found if r.fits), None)
        answer = answers.get(name)
        if best is not None and answer is not None and best.layout.gpus < answer.configuration.gpus:
            planner.notes.append(
                f"{name}: tp {best.layout.tp} x pp {best.layout.pp} x dp {best.layout.dp} fits on "
                f"{best.layout.gpus} GPUs, fewer than data parallelism alone "
                f"({answer.configuration.gpus})"
            )
    return results


__all__ = ["DerivedPeaks", "Plan", "fewest", "model_facts", "plan"]
