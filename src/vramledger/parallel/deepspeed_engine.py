"""DeepSpeed's engine (without ZeRO, and ZeRO stages 1, 2 and 3), run as DeepSpeed runs it.

``zero1`` and ``zero2`` build DeepSpeed's own ``DeepSpeedEngine`` around the model; its
``DeepSpeedZeroOptimizer`` flattens the parameters into one buffer, partitions it evenly over the
ranks (``deepspeed_layout.py``), keeps the fp32 master weights and optimizer state of this
rank's partition, and reduces gradients through its bucket. Each step is DeepSpeed's own
``engine(batch)`` / ``engine.backward(loss)`` / ``engine.step()``, with its own precision
handling (loss scaling, master weights, norms), so nothing of ``training.py``'s step runs.

``zero3`` builds the same engine with its ``DeepSpeedZeroOptimizer_Stage3``: each parameter
partitioned on its own over the ranks, gathered by DeepSpeed's own module hooks for the
module's compute and released after, its prefetch, live-parameter and bucket limits as the
config or DeepSpeed's defaults give them (``deepspeed_zero3.py``, shared with the trace of a
user's program that builds ZeRO-3 itself).

``zero0`` (a ``--deepspeed`` config of stage 0) builds the same engine with ZeRO off: its own
optimizer wrapper (``FP16_UnfusedOptimizer``'s fp32 copies in bf16/fp16, none in fp32), and at
the accumulation boundary the gradients flattened into one buffer per reduction
(``buffered_allreduce_fallback``), all-reduced, copied back and dropped, on one process too
(``gradient_buckets`` while it lives).

The same code builds the step of an estimate (fake tensors, a fake process group: one rank of
``world_size`` in this process) and of a real run (``measure/deepspeed.py``). A fake run needs
what DeepSpeed cannot do by itself, each the least that lets its code run:

1. ``DeepSpeedEngine(..., dont_change_device=True)``: ``module.to(device)`` cannot run on fake
   parameters (they already are on the traced device);
2. DeepSpeed's global state for a fake process group (``deepspeed_runtime.py``): its CPU
   accelerator standing for the GPU, ``LOCAL_RANK``, fresh caches of process groups;
3. values read with ``.item()`` (the overflow check, the gradient norm) answered 0: no
   overflow, the step every run takes when it does not skip (``trace/core/tracker.py``);
4. under ZeRO-3, its checks that every rank has rank 0's order of parameters answered with the
   rank's own (``deepspeed_zero3.rank0_lists_own``).

Categories: the flat half-precision buffer (every parameter is a view of it) is
``parameters``; the fp32 partition ``master_weights``; the wrapped optimizer's state
``optimizer_state``; gradients as autograd makes them ``gradients``; DeepSpeed's reduce
bucket(s) ``gradient_buckets``; the gradients a rank keeps for its partition
(``grads_in_partition`` and the flat partition made from them) ``sharded_gradients``; the fp32
gradient of the partition made for the step is a temporary, labelled as such. Under ZeRO-3 the
flat shard of the parameters is ``sharded_parameters``, its gradients' flat buffer
``sharded_gradients``, each module's gathered parameters ``all_gather_buffers``.

Offload (``--offload optimizer``) is applied by category after the trace, as for every strategy
(``strategy.py``): DeepSpeed's own offload path needs its CPU Adam extension and pinned memory,
which a fake trace cannot run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.deepspeed_config import DEEPSPEED_HINT
from vramledger.inputs.errors import InputError
from vramledger.inputs.jsonfile import read_json_object
from vramledger.inputs.optimizers import OptimizerChoice
from vramledger.inputs.precision import PrecisionPolicy
from vramledger.inputs.recipe import Recipe
from vramledger.inputs.sources import LossFn, tensor_leaves
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.training import MASTER_GRADIENT, StepObserver, cast_floating
from vramledger.parallel.deepspeed_runtime import (
    deepspeed_modules,
    fake_deepspeed_world,
    quiet,
    version,
)
from vramledger.parallel.deepspeed_zero3 import gathers_tagged, rank0_lists_own
from vramledger.parallel.engines import DataParallel, fake_world
from vramledger.trace.program.program_trace import STANDS_FOR

DEEPSPEED_PRECISIONS = {
    "fp32": {},
    "bf16-master": {"bf16": {"enabled": True}},
    "fp16-master": {"fp16": {"enabled": True}},
    "bf16-mixed": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
}
"""DeepSpeed config sections of the precisions its ZeRO-1/2 engine runs: its bf16/fp16 modes
keep the half-precision model and fp32 master weights of the partition (``*-mixed``); its
``torch_autocast`` runs the forward under ``torch.autocast`` with an fp32 model. (bf16 master
weights need DeepSpeed's CPU offload and CPU Adam, which a trace cannot run.)"""
PASSED_ZERO_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "reduce_scatter",
    "contiguous_gradients",
    "round_robin_gradients",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)
"""``zero_optimization`` keys of a ``--deepspeed`` config given to the engine as they are
(those of ZeRO-3 read by stage 3 only); what is not given is DeepSpeed's default
(``DeepSpeedZeroConfig``, deepspeed/runtime/zero/config.py)."""
PASSED_TOP_KEYS = (
    "gradient_clipping",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
)
"""Top-level keys of a ``--deepspeed`` config given to the engine as they are."""
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
"""Elements per flat buffer DeepSpeed's engine reduces gradients through without ZeRO
(``MEMORY_OPT_ALLREDUCE_SIZE``, deepspeed/runtime/engine.py: ``allreduce_gradients``' bucket)."""
FUSED_ADAM = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers DeepSpeed runs as its FusedAdam on a GPU (``"optimizer": {"type": "Adam(W)"}``);
modelled on a CUDA target as torch's fused implementation: multi-tensor and in place, no step
temporaries."""


def deepspeed_config(spec: TrainingSpec) -> dict[str, Any]:
    """The DeepSpeed config the engine is built with: the spec's stage, precision, micro-batch and
    accumulation, plus the memory-relevant keys of the user's ``--deepspeed`` config."""
    stage = spec.parallelism.deepspeed_stage
    assert stage is not None, f"{spec.strategy} is not a DeepSpeed strategy"
    if spec.precision not in DEEPSPEED_PRECISIONS:
        raise InputError(
            f"DeepSpeed ZeRO-{stage} does not train in {spec.precision}",
            hint=f"use one of {', '.join(DEEPSPEED_PRECISIONS)} (DeepSpeed's modes), or "
            "--strategy zero1-torch (ZeroRedundancyOptimizer)",
        )
    zero: dict[str, Any] = {"stage": stage}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.batch_size,
        "gradient_accumulation_steps": spec.grad_accum,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        **DEEPSPEED_PRECISIONS[spec.precision],
    }
    if spec.deepspeed is not None:
        user = read_json_object(spec.deepspeed, "DeepSpeed config", hint=DEEPSPEED_HINT)
        zero.update(
            {k: v for k, v in user.get("zero_optimization", {}).items() if k in PASSED_ZERO_KEYS}
        )
        config.update({k: v for k, v in user.items() if k in PASSED_TOP_KEYS})
    return config


def gpu_optimizer(
    choice: OptimizerChoice, spec: TrainingSpec
) -> tuple[OptimizerChoice, str | None]:
    """The optimizer DeepSpeed steps on a GPU: Adam/AdamW is its FusedAdam, modelled by torch's
    fused implementation, unless the user chose an implementation."""
    if spec.target != "cuda" or choice.cls not in FUSED_ADAM:
        return choice, None
    if {"foreach", "fused"} & set(spec.optimizer_kwargs):
        return choice, None
    note = (
        f"{choice.cls.__name__} under DeepSpeed on a GPU is its FusedAdam (multi-tensor, in "
        "place): traced as torch's fused implementation (no step temporaries)"
    )
    return replace(choice, kwargs={**choice.kwargs, "fused": True}), note


@dataclass(kw_only=True)
class DeepSpeedRun:
    """A model inside DeepSpeed's engine, ready to step (``TrainingRun``'s interface)."""

    engine: Any
    batch: Any
    loss_fn: LossFn
    grad_accum: int
    labels: _Labels
    during_step: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    """Entered around each step (ZeRO-3: its gathered parameters told as they are made)."""
    record_losses: bool = False
    losses: list[float] = field(default_factory=list)

    @property
    def zero(self) -> Any:
        return self.engine.optimizer

    @property
    def stepped(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps: inside DeepSpeed's wrapper, or the engine's own
        (stage 0 in fp32 wraps nothing)."""
        return getattr(self.zero, "optimizer", self.zero)

    def run(self, steps: int, observer: StepObserver) -> None:
        for step in range(1, steps + 1):
            self.step(step, observer)

    def step(self, step: int, observer: StepObserver) -> None:
        with self.during_step():
            self._step(step, observer)

    def _step(self, step: int, observer: StepObserver) -> None:
        total = 0.0
        for _ in range(self.grad_accum):
            observer.phase(step, Phase.FORWARD)
            loss = self.loss_fn(self.engine, self.batch)
            if self.record_losses:
                total += float(loss.detach().float().item()) / self.grad_accum
            observer.phase(step, Phase.BACKWARD)
            self.engine.backward(loss)
            self.labels.kept_gradients()
            del loss
            observer.phase(step, Phase.OPTIMIZER)
            self.engine.step()  # a step at the accumulation boundary, else only counts
        if self.record_losses:
            self.losses.append(total)
        observer.optimizer_stepped(self.stepped)


def build_run(
    *,
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: OptimizerChoice,
    precision: PrecisionPolicy,
    spec: TrainingSpec,
    observer: StepObserver,
    fake: bool,
) -> tuple[DeepSpeedRun, list[str]]:
    """Build DeepSpeed's engine around ``model`` (already on its device, in its dtype), telling
    the observer what each of DeepSpeed's buffers is."""
    if optimizer.builder is not None:
        raise InputError(
            f"{optimizer.name} is traced through a stand-in, which DeepSpeed's engine cannot wrap",
            hint="use a torch.optim or torchao optimizer, or --strategy zero1-torch",
        )
    if precision.param_dtype is not torch.float32:
        batch = cast_floating(batch, precision.param_dtype)
    modules = deepspeed_modules()
    params = [p for p in model.parameters() if p.requires_grad]
    observer.tensors(model.parameters(), Category.PARAMETERS)
    observer.tensors(model.buffers(), Category.BUFFERS)
    observer.tensors(tensor_leaves(batch), Category.INPUTS)
    notes = []
    inner = optimizer.build(params)
    labels = _Labels(observer)
    for p in params:  # registered before DeepSpeed's hooks, so they see autograd's gradient
        p.register_post_accumulate_grad_hook(labels.fresh_gradient)
    config = deepspeed_config(spec)
    with quiet():
        engine = modules.engine_class(
            args=None,
            model=model,
            optimizer=inner,
            model_parameters=params,
            config=config,
            config_class=modules.config_class(config),
            dont_change_device=fake,
        )
    zero = engine.optimizer
    on_group = f" on a fake process group of {spec.world_size} ranks" if fake else ""
    during_step: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if spec.parallelism.is_deepspeed_zero3:
        if type(zero).__name__ != "DeepSpeedZeroOptimizer_Stage3":
            raise InputError(
                f"DeepSpeed built {type(zero).__name__}, not its ZeRO-3 optimizer",
                hint="check the --deepspeed config",
            )
        tag_optimizer_buffers(zero, labels._tag)
        notes.append(zero3_note(spec, engine, on_group))

        def during_step() -> contextlib.AbstractContextManager[Any]:
            return gathers_tagged(labels._tag)

    elif not spec.parallelism.is_deepspeed_zero:
        labels.watch_engine(engine)
        notes.append(
            f"{spec.strategy}: DeepSpeed {version()}'s own engine without ZeRO (DeepSpeedEngine, "
            f"{type(zero).__name__}){on_group}: at the accumulation boundary it flattens the "
            f"gradients into one buffer per reduction of up to {ALLREDUCE_BUCKET_ELEMENTS:,} "
            "elements, on one process too (engine.py: buffered_allreduce_fallback)"
        )
    elif not isinstance(zero, modules.zero_optimizer):
        raise InputError(
            f"DeepSpeed built {type(zero).__name__}, not its ZeRO-1/2 optimizer",
            hint="check the --deepspeed config",
        )
    else:
        labels.watch(zero)
        notes.append(
            f"{spec.strategy}: DeepSpeed {version()}'s own engine (DeepSpeedEngine, "
            f"DeepSpeedZeroOptimizer stage {spec.parallelism.deepspeed_stage}){on_group}: flat "
            f"partition of {zero.partition_size[0]:,} elements per rank, reduce bucket of "
            f"{zero.reduce_bucket_size:,} elements"
        )
    run = DeepSpeedRun(
        engine=engine,
        batch=batch,
        loss_fn=loss_fn,
        grad_accum=spec.grad_accum,
        labels=labels,
        during_step=during_step,
    )
    return run, notes


def zero3_note(spec: TrainingSpec, engine: Any, on_group: str) -> str:
    """What ZeRO-3 ran with: its partition and the limits of its gathers and buckets (the
    config's, else DeepSpeed's defaults, as the engine read them)."""
    zero = engine.optimizer
    shard = sum(t.numel() for t in zero.fp16_partitioned_groups_flat)
    note = (
        f"{spec.strategy}: DeepSpeed {version()}'s own engine (DeepSpeedEngine, "
        f"DeepSpeedZeroOptimizer_Stage3){on_group}: each parameter partitioned over the ranks, "
        f"a flat shard of {shard:,} elements per rank in {len(zero.fp16_groups)} sub-group(s) "
        f"(sub_group_size {engine.zero_sub_group_size():,}); parameters gathered by "
        f"DeepSpeed's module hooks, prefetching up to {engine.zero_prefetch_bucket_size():,} "
        f"elements (stage3_prefetch_bucket_size), at most "
        f"{engine.zero_max_live_parameters():,} gathered (stage3_max_live_parameters), reuse "
        f"distance {engine.zero_max_reuse_distance():,}, parameters under "
        f"{engine.zero_param_persistence_threshold():,} elements kept whole "
        f"(stage3_param_persistence_threshold); reduce bucket of "
        f"{engine.zero_reduce_bucket_size():,} elements"
    )
    return note


def tag_optimizer_buffers(
    zero: Any, register: Callable[[list[torch.Tensor], Category], None]
) -> None:
    """The buffers of DeepSpeed's optimizer wrappers (its ZeRO-1/2 optimizer's are tagged by
    ``_Labels.watch``): the fp32 partitions each steps are master weights, standing for the
    trainable parameters of their group (``STANDS_FOR``), as are ``FP16_Optimizer``'s and
    ``FP16_UnfusedOptimizer``'s fp32 copies (ZeRO stage 0 in fp16 or bf16); ``BF16_Optimizer``
    keeps the flat bf16 parameters and flat fp32 gradients of the whole model; ZeRO-3 keeps
    the rank's flat shard of the bf16 parameters and of the gradients, and its reduce bucket
    (one per communication dtype, made at set-up with ``contiguous_gradients``)."""
    name = type(zero).__name__
    if name == "DeepSpeedZeroOptimizer":
        masters, groups = zero.single_partition_of_fp32_groups, zero.bit16_groups
    elif name == "BF16_Optimizer":
        register(list(zero.bf16_groups_flat), Category.PARAMETERS)
        register(list(zero.fp32_groups_gradients_flat), Category.GRADIENTS)
        masters, groups = zero.fp32_groups_flat_partition, zero.bf16_groups
    elif name == "DeepSpeedZeroOptimizer_Stage3":
        register(list(zero.fp16_partitioned_groups_flat), Category.SHARDED_PARAMETERS)
        register([zero.grad_partitions_flat_buffer], Category.SHARDED_GRADIENTS)
        buckets = [b.buffer for b in zero.ipg_buckets.values() if b.buffer is not None]
        register(buckets, Category.GRADIENT_BUCKETS)
        masters, groups = zero.fp32_partitioned_groups_flat, zero.fp16_groups
    elif name == "FP16_Optimizer":
        masters, groups = zero.fp32_groups_flat, zero.fp16_groups
    elif name == "FP16_UnfusedOptimizer":  # an fp32 copy of each parameter
        masters = [m for group in zero.fp32_groups for m in group]
        groups = [[p] for group in zero.fp16_groups for p in group]
    else:  # the program's (or the spec's) own optimizer, stepped as it is
        return
    register(list(masters), Category.MASTER_WEIGHTS)
    for master, group in zip(masters, groups, strict=True):
        # a ZeRO-3 parameter's own elements are gone once partitioned: ds_numel has them
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in group if p.requires_grad)
        setattr(master, STANDS_FOR, numel)


FRESH_GRADIENT = "autograd's gradient, until DeepSpeed copies it into its reduce bucket"


class _Labels:
    """Tells the observer what DeepSpeed's buffers are, at the moments DeepSpeed makes them
    (wrapping the optimizer's own methods: they run unchanged).

    A gradient autograd makes is ``gradients`` if it is still the parameter's gradient when
    DeepSpeed reduces (ZeRO-1 keeps every full gradient through backward); under ZeRO-2
    DeepSpeed copies each into its bucket as it is made and frees it: a temporary, labelled."""

    def __init__(self, observer: StepObserver) -> None:
        self.observer = observer
        self.engine_buffers: dict[int, weakref.ref] = {}  # alive DeepSpeed buffers' storages
        self.fresh: dict[int, tuple[torch.Tensor, int]] = {}

    def _tag(self, tensors: list[torch.Tensor], category: Category) -> None:
        self.observer.tensors(tensors, category)
        for t in tensors:
            storage = t.untyped_storage()
            self.engine_buffers[storage._cdata] = weakref.ref(storage)

    def _engine_buffer(self, t: torch.Tensor) -> bool:
        ref = self.engine_buffers.get(t.untyped_storage()._cdata)
        return ref is not None and ref() is not None

    def fresh_gradient(self, p: torch.Tensor) -> None:
        """A gradient autograd just made (this hook runs before DeepSpeed's)."""
        if p.grad is None or self._engine_buffer(p.grad):
            return
        # the storage's address only: nothing is kept alive
        self.fresh[id(p)] = (p, p.grad.untyped_storage()._cdata)
        self.observer.label([p.grad], FRESH_GRADIENT)

    def kept_gradients(self) -> None:
        """Before DeepSpeed reduces, and after each backward: the gradients autograd made that
        are still the parameters' are ``gradients``."""
        for p, storage in self.fresh.values():
            if p.grad is not None and p.grad.untyped_storage()._cdata == storage:
                self.observer.tensors([p.grad], Category.GRADIENTS)
        self.fresh.clear()

    def watch_engine(self, engine: Any) -> None:
        """DeepSpeed's engine without ZeRO (stage 0): its optimizer wrapper's buffers
        (:func:`tag_optimizer_buffers`), and each flat buffer it reduces the gradients through
        (``allreduce_bucket``), made and dropped at the accumulation boundary."""
        tag_optimizer_buffers(engine.optimizer, self._tag)
        reduce = engine.allreduce_bucket

        def reduced(*args: Any, **kwargs: Any) -> torch.Tensor:
            flat = reduce(*args, **kwargs)
            self.observer.tensors([flat], Category.GRADIENT_BUCKETS)
            return flat

        engine.allreduce_bucket = reduced
        _before(engine, "buffered_allreduce_fallback", lambda *_, **__: self.kept_gradients())

    def watch(self, zero: Any) -> None:
        self._tag(list(zero.bit16_groups_flat), Category.PARAMETERS)
        self._tag(list(zero.single_partition_of_fp32_groups), Category.MASTER_WEIGHTS)

        def buckets() -> None:
            self._tag(
                [b for bucket in zero.ipg_buckets.values() for b in bucket.buffer],
                Category.GRADIENT_BUCKETS,
            )

        def kept() -> None:
            if zero.grads_in_partition is not None:
                self._tag([zero.grads_in_partition], Category.SHARDED_GRADIENTS)

        def averaged() -> None:
            found = [
                t
                for g in zero.averaged_gradients.values()
                if g is not None
                for t in tensor_leaves(g)
            ]
            self._tag(found, Category.SHARDED_GRADIENTS)

        def fp32_gradient(i: int) -> None:
            grad = zero.single_partition_of_fp32_groups[i].grad
            if grad is not None:
                self.observer.label([grad], MASTER_GRADIENT)

        _before(zero, "reduce_gradients", lambda *_, **__: self.kept_gradients())
        _before(zero, "independent_gradient_partition_epilogue", lambda: self.kept_gradients())
        _after(zero, "setup_buckets", buckets)
        _after(zero, "copy_grads_in_partition", kept)
        _after(zero, "independent_gradient_partition_epilogue", averaged)
        _before(zero, "_optimizer_step", fp32_gradient)


def _after(owner: Any, name: str, then: Callable[[], None]) -> None:
    method = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        then()
        return out

    setattr(owner, name, wrapped)


def _before(owner: Any, name: str, first: Callable[..., None]) -> None:
    method = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        first(*args, **kwargs)
        return method(*args, **kwargs)

    setattr(owner, name, wrapped)


class DeepSpeedZero(DataParallel):
    """The ``trace.engine.Engine`` of ``zero0``..``zero3``: each traced run is one rank of
    DeepSpeed's engine on a fake process group (offload applied after, as ``DataParallel``)."""

    def __init__(self, spec: TrainingSpec) -> None:
        super().__init__(spec)
        self.optimizer_note: str | None = None

    def adapt(self, recipe: Recipe) -> Recipe:
        deepspeed_config(self.spec)  # refuses what DeepSpeed's engine does not run
        optimizer, self.optimizer_note = gpu_optimizer(recipe.optimizer, self.spec)
        return replace(recipe, optimizer=optimizer)

    @contextlib.contextmanager
    def rank(self, rank: int) -> Iterator[DeepSpeedRank]:
        zero3 = self.spec.parallelism.is_deepspeed_zero3
        notes = [self.optimizer_note] if self.optimizer_note else []
        with (
            fake_world(rank, self.spec.world_size),
            fake_deepspeed_world(),
            # the rank's notes say the check was answered when DeepSpeed ran one
            rank0_lists_own(notes) if zero3 else contextlib.nullcontext(),
        ):
            yield DeepSpeedRank(spec=self.spec, rank=rank, notes=notes)


@dataclass
class DeepSpeedRank:
    """One rank of DeepSpeed's engine in a trace (a ``trace.engine.RankEngine`` that builds its
    own step)."""

    spec: TrainingSpec
    rank: int
    notes: list[str] = field(default_factory=list)
    op_categories: dict[str, Category] = field(default_factory=dict)
    resize_category: Category | None = None
    scalar_answer: int = 0
    """``.item()`` answers: 0 is "no overflow" to DeepSpeed's overflow check."""

    def wrap(self, model: nn.Module, blocks: list[nn.Module], precision_name: str) -> nn.Module:
        return model

    def owned(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return params

    def add_buckets(self, model: nn.Module, track: Any) -> None:
        pass

    def assemble(
        self, *, device: Any, grad_accum: int, owned: Any = None, **parts: Any
    ) -> DeepSpeedRun:
        """DeepSpeed's engine over ``training.assemble``'s parts (model, batch, loss_fn,
        optimizer, precision, observer); the device, the accumulation and the partition each
        rank steps are DeepSpeed's own (its config, from the spec)."""
        run, notes = build_run(**parts, spec=self.spec, fake=True)
        self.notes.extend(notes)
        return run
