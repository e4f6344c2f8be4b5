"""Run the real training step on fake tensors: the model is built on the meta device (no
initialisation, no memory), its parameters become fake CPU tensors, and the step runs under
``FakeTensorMode`` with the storage tracker and the target's device policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from vramledger.inputs.adapters import adapter_notes, carry_quantization, quantization_state
from vramledger.inputs.attention import AttentionCalls, built_implementation, implementation_note
from vramledger.inputs.categories import Category
from vramledger.inputs.config_depth import config_depth
from vramledger.inputs.errors import InputError, VramledgerError
from vramledger.inputs.notes import Note, Topic, tagged
from vramledger.inputs.optimizers import OptimizerChoice
from vramledger.inputs.recipe import Recipe, count_parameters, module_names, resolve
from vramledger.inputs.sources import map_tensors
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.training import assemble
from vramledger.record.timeline import Timeline
from vramledger.trace.core.blocks import (
    HEAD,
    MIN_BLOCKS,
    SMALL,
    BlockStack,
    NotExtensible,
    extend,
    extended_counts,
    extension_note,
    find_block_stack,
    same_timeline,
    truncate,
)
from vramledger.trace.core.cache import load as load_trace
from vramledger.trace.core.cache import save as save_trace
from vramledger.trace.core.cache import trace_key
from vramledger.trace.core.engine import Engine, RankEngine, SingleDevice
from vramledger.trace.core.hf_compat import hf_known_values, ordinary_batches
from vramledger.trace.core.optimizer_stand_ins import TORCHAO_NOTE, stand_in, warm_library_caches
from vramledger.trace.core.step_memo import repeated_steps
from vramledger.trace.core.trace_errors import trace_error
from vramledger.trace.core.tracker import StorageTracker, TrackerObserver
from vramledger.trace.core.values import CONCRETE_ROUTINGS, KnownValues
from vramledger.trace.emulation.policy import DevicePolicy
from vramledger.trace.session import Traced, trace_session, tracker_notes, tracker_options

TRACE_DEVICE = torch.device("cpu")
"""Fake tensors carry the CPU device: CPU-only PyTorch cannot run autograd on fake CUDA tensors
(``InputMetadata`` asks for a CUDA device guard and the process aborts)."""


@dataclass(frozen=True, kw_only=True)
class TraceResult(Traced):
    """One traced step of vramledger's own: its timeline and what the ledger says beside it."""

    model_name: str
    optimizer_state_bytes: int
    """Bytes of ``optimizer.state`` after the last step, and how they were found
    (``optimizer_state_method``)."""
    optimizer_state_method: str
    routing_dependent: dict[str, str] = field(default_factory=dict)
    """Value-dependent operators that read MoE routing values (operator -> module): the memory
    depends on the routing policy (``trace/core/values.py``)."""


@dataclass(kw_only=True)
class TraceLog:
    """What the traces of one estimate found besides the timeline."""

    notes: list[str] = field(default_factory=list)
    routing_dependent: dict[str, str] = field(default_factory=dict)
    routing: str = "balanced"


def fakeify(model: nn.Module, mode: FakeTensorMode, device: torch.device) -> None:
    """Replace meta parameters and buffers by fake tensors on ``device``, keeping ties."""
    converter = mode.fake_tensor_converter
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in memo:
                fake = converter.from_meta_and_device(mode, _meta(p.detach()), device)
                memo[id(p)] = carry_quantization(
                    p,
                    nn.Parameter(fake, requires_grad=p.requires_grad),
                    lambda t: converter.from_meta_and_device(mode, _meta(t), device),
                )
            module._parameters[name] = memo[id(p)]
        for name, b in module._buffers.items():
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = converter.from_meta_and_device(mode, _meta(b), device)
            module._buffers[name] = memo[id(b)]


def _meta(t: torch.Tensor) -> torch.Tensor:
    """On the meta device: a few models make parameters with factories the device context does
    not reach (``torch.normal(mean, std, size=...)`` in DiffLlama)."""
    return t if t.is_meta else t.to("meta")


def trace(
    spec: TrainingSpec,
    policy: DevicePolicy,
    *,
    extend_blocks: bool = True,
    rank: int = 0,
    routing: str | None = None,
    engine: Engine | None = None,
    blocks_verified: bool = False,
) -> TraceResult:
    """Run ``spec.steps`` training steps on fake tensors under ``policy``; return the Timeline.

    Models made of many identical blocks are traced with a few blocks and extended exactly
    (``blocks.py``); if the extension cannot be verified, every block is traced. ``routing``: the
    MoE routing policy the trace answers routers with (default: the spec's, ``balanced`` for
    ``worst``, which ``predict/step.py`` makes of several traces). ``engine``: what the step runs
    under (``trace/core/engine.py``; ``parallel/`` has the data-parallel ones), default one device.
    ``blocks_verified``: the extension was verified exact on this same run at another
    data-parallel or tensor-parallel degree, offload setting, micro-batch or sequence length (a
    plan's re-estimates, ``plan/runner.py``; fit's sizes, ``plan/fit_estimates.py``): only ``SMALL`` blocks are traced and extended, without tracing
    ``SMALL + 1`` to check it again. A trace made before for the same key is read from the
    cache (``trace/core/cache.py``) instead.
    """
    start = time.perf_counter()
    if routing is None:
        routing = spec.moe_routing if spec.moe_routing in CONCRETE_ROUTINGS else "balanced"
    engine = engine or SingleDevice()
    key = trace_key(
        spec,
        policy,
        engine,
        extend_blocks=extend_blocks,
        rank=rank,
        routing=routing,
        blocks_verified=blocks_verified,
    )
    gpu_notes = policy.notes()  # before the trace: what names the GPU (trace/core/cache.py)
    cached = load_trace(key, {f.name for f in fields(TraceResult)}, gpu_notes)
    if cached is not None:
        return TraceResult(**{**cached, "seconds": time.perf_counter() - start})
    result = _trace(spec, policy, extend_blocks, rank, routing, engine, blocks_verified, start)
    save_trace(key, result, gpu_notes)
    return result


def _trace(
    spec: TrainingSpec,
    policy: DevicePolicy,
    extend_blocks: bool,
    rank: int,
    routing: str,
    engine: Engine,
    blocks_verified: bool,
    start: float,
) -> TraceResult:
    resolved = resolve(spec)
    recipe = engine.adapt(resolved)
    log = TraceLog(notes=[recipe.dtype_note()])
    if recipe.make_inputs.note:
        log.notes.append(Note(Topic.INPUTS, recipe.make_inputs.note))
    notes = log.notes
    choice = stand_in(policy.optimizer(recipe.optimizer), policy.name)
    warm_library_caches(choice)
    if choice.package == "torchao":
        notes.append(TORCHAO_NOTE)
    log.routing = routing
    result = (
        _extended(recipe, choice, policy, log, engine, rank, verified=blocks_verified)
        if extend_blocks
        else None
    )
    if result is None:
        model = recipe.build_model("meta")
        counts = count_parameters(model)
        timeline = _run(recipe, choice, model, policy, log, engine, rank=rank)
    else:
        timeline, counts = result
    notes.extend(tagged(engine.finish(timeline, resolved), Topic.ENGINE))
    return TraceResult(
        timeline=timeline,
        model_name=recipe.source.name,
        parameters=counts[0],
        trainable_parameters=counts[1],
        optimizer_state_bytes=timeline.live_at_end(Category.OPTIMIZER_STATE),
        optimizer_state_method=choice.method,
        seconds=time.perf_counter() - start,
        notes=list(dict.fromkeys(policy.notes() + notes)),
        routing_dependent=log.routing_dependent,
        extended=result is not None,
    )


def _extended(
    recipe: Recipe,
    choice: OptimizerChoice,
    policy: DevicePolicy,
    log: TraceLog,
    engine: Engine,
    rank: int = 0,
    *,
    verified: bool = False,
) -> tuple[Timeline, tuple[int, int]] | None:
    """Trace SMALL and SMALL + 1 blocks; if extending the first reproduces the second exactly,
    extend it to the full depth. A Hugging Face config says its depth, so the full model is
    never built; Python models are built (on meta) to find their blocks. ``verified``: the check
    was made on the same run at another data-parallel or tensor-parallel degree, offload
    setting, micro-batch or sequence length; only SMALL is traced."""
    depth = config_depth(recipe.source.config)
    if depth is not None:
        if depth < MIN_BLOCKS:
            return None
        try:
            models = {d: recipe.at_depth(d).build_model("meta") for d in (SMALL, SMALL + 1)}
        except InputError as exc:  # an option naming deep blocks only (--freeze 'layers.2?.*')
            log.notes.append(
                Note(Topic.EXTENT, f"traced every block (the {SMALL}-block model: {exc.message})")
            )
            return None
        stack = find_block_stack(models[SMALL], min_blocks=SMALL)
        if stack is None or stack.length != SMALL:
            log.notes.append(
                Note(
                    Topic.EXTENT,
                    f"traced every block (the {SMALL}-block model has no list of {SMALL} blocks "
                    "alike in class, parameters and trainability)",
                )
            )
            return None
        uneven = recipe.index_dependent_option(
            models[SMALL], stack.fqn, range(HEAD, max(depth, SMALL + 1))
        )
        if uneven is not None:  # blocks kept as traced (below HEAD) may differ
            log.notes.append(Note(Topic.EXTENT, f"traced every block of {stack.fqn} ({uneven})"))
            return None
        stack = BlockStack(fqn=stack.fqn, length=depth)
    else:
        full = recipe.build_model("meta")
        stack = find_block_stack(full)
        if stack is None:
            return None
        models = {}
        for d in (SMALL, SMALL + 1):
            models[d] = recipe.build_model("meta")
            truncate(models[d], stack, d)
    counts = {d: count_parameters(m) for d, m in models.items()}
    try:
        # The engine raises NotExtensible when its units are not the blocks (named FSDP units).
        traced = {
            d: _run(recipe, choice, models[d], policy, log, engine, stack=stack, rank=rank)
            for d in models
            if d == SMALL or not verified
        }
        if verified:  # extending SMALL blocks was shown to reproduce SMALL + 1 on this run
            full_timeline = extend(traced[SMALL], SMALL, stack.length, stack.fqn)
        else:
            check = extend(traced[SMALL], SMALL, SMALL + 1, stack.fqn)
            if not same_timeline(check, traced[SMALL + 1]):
                raise NotExtensible("the extended trace differs from the traced one")
            full_timeline = extend(traced[SMALL + 1], SMALL + 1, stack.length, stack.fqn)
    except NotExtensible as exc:
        log.notes.append(Note(Topic.EXTENT, f"traced every block of {stack.fqn} ({exc})"))
        return None
    log.notes.append(extension_note(stack.fqn, stack.length, verified_elsewhere=verified))
    return full_timeline, extended_counts(counts[SMALL], counts[SMALL + 1], stack.length)


def _run(
    recipe: Recipe,
    choice: OptimizerChoice,
    model: nn.Module,
    policy: DevicePolicy,
    log: TraceLog,
    engine: Engine,
    *,
    stack: BlockStack | None = None,
    rank: int = 0,
) -> Timeline:
    with engine.rank(rank) as rank_engine:
        return _run_rank(recipe, choice, model, policy, log, stack, rank_engine)


def _run_rank(
    recipe: Recipe,
    choice: OptimizerChoice,
    model: nn.Module,
    policy: DevicePolicy,
    log: TraceLog,
    stack: BlockStack | None,
    engine: RankEngine,
) -> Timeline:
    spec = recipe.spec
    notes = log.notes
    names = module_names(model)
    built_attention = built_implementation(model)
    notes.extend(adapter_notes(model))
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakeify(model, mode, TRACE_DEVICE)
    values = KnownValues(mode, routing=log.routing)
    values.seq_len_option = "seq_len" in recipe.make_inputs.uses
    real_batch = recipe.make_batch(TRACE_DEVICE)
    blocks: list[nn.Module] = list(model.get_submodule(stack.fqn)) if stack is not None else []
    with mode:
        model = engine.wrap(model, blocks, recipe.precision.name)
    tracker = _tracker(names, policy, engine, blocks, values)
    observer = TrackerObserver(tracker, policy.host_resident)
    attention = AttentionCalls()
    # the session every trace runs in (trace/session.py), with this driver's own patches inside
    inner = (ordinary_batches(notes), hf_known_values(values), values.formatting(), attention)
    with (
        mode,
        trace_session(policy, tracker, notes, inner=inner),
        # torchao's per-parameter steps: each argument layout traced once, then replayed
        repeated_steps(tracker),
    ):
        tracker.label_blocks(blocks)
        try:
            batch = fake_batch(real_batch, mode, values)
            # An engine that runs its own step (DeepSpeed) builds it; else training.py's.
            build = getattr(engine, "assemble", assemble)
            run = build(
                model=model,
                batch=batch,
                loss_fn=recipe.loss_fn,
                optimizer=choice,
                precision=recipe.precision,
                device=TRACE_DEVICE,
                grad_accum=spec.grad_accum,
                observer=observer,
                owned=engine.owned,
            )
            engine.add_buckets(model, tracker.track)
            run.run(spec.steps, observer)
        except VramledgerError:
            raise
        except Exception as exc:
            raise trace_error(exc, tracker, spec.target) from exc
    timeline = tracker.close()
    if (note := implementation_note(attention, built_attention)) is not None:
        notes.append(note)
    log.routing_dependent.update(values.routing_dependent)
    _add_run_notes(notes, values, log, engine, tracker)
    return timeline


def _tracker(
    names: dict[int, str],
    policy: DevicePolicy,
    engine: RankEngine,
    blocks: list[nn.Module],
    values: KnownValues,
) -> StorageTracker:
    """The storage tracker of one rank's trace: the policy's scratch probe, the engine's
    categories, the repeated blocks and their tensors labelled."""
    return StorageTracker(
        module_names=names,
        scalar_answer=getattr(engine, "scalar_answer", 1),
        blocks={id(b): k for k, b in enumerate(blocks)},
        tensor_blocks={
            id(t): k
            for k, b in enumerate(blocks)
            for t in (*b.parameters(), *quantization_state(b.parameters()))
        },
        **tracker_options(
            policy,
            values,
            op_categories=engine.op_categories,
            resize_category=engine.resize_category,
        ),
    )


def _add_run_notes(
    notes: list[str],
    values: KnownValues,
    log: TraceLog,
    engine: RankEngine,
    tracker: StorageTracker,
) -> None:
    """What a traced run answered in place of values fake tensors lack (random draws, MoE
    routing, ``.item()`` in the optimizer), the engine's notes and the plain-path branches."""
    if values.draws:
        notes.append(
            Note(
                Topic.VALUES,
                f"{values.draws} uniform random draws answered at the top of their range: code that "
                "compares a draw with a probability takes the branch that keeps everything "
                "(layerdrop keeps every layer, the most memory)",
            )
        )
    if values.routed_ops and not values.routing_dependent:  # else predict.py reports the band
        notes.append(
            Note(
                Topic.VALUES,
                f"MoE routers ({', '.join(sorted(values.routed_ops))}) answered with the "
                f"{log.routing} routing; the memory does not depend on the routing (no "
                "value-dependent operator read it)",
            )
        )
    notes.extend(n for n in tagged(engine.notes, Topic.ENGINE) if n not in notes)
    notes.extend(tracker_notes(tracker))


def fake_batch(batch: Any, mode: FakeTensorMode, values: KnownValues) -> Any:
    """The real batch as fake tensors whose values are known."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        fake = mode.from_tensor(t)
        values.register(fake, t)
        return fake

    return map_tensors(convert, batch)
