"""A dispatch-level storage tracker: sees every tensor storage an operator creates and frees.

It is a ``TorchDispatchMode`` (as PyTorch's ``torch/distributed/_tools/mem_tracker.py``), kept
lean: one dict lookup per operator output, a weakref callback per storage for its free, no
per-operator snapshots. The same tracker records fake-tensor traces and real runs, so a
prediction and a measurement come out as the same ``Timeline``.

Categories are decided by what a storage turns out to be, not when it was made:
parameters, buffers, inputs and master weights are tagged at registration; ``param.grad`` after
each backward; ``optimizer.state`` after each step; storages made during forward (or during its
recomputation under activation checkpointing) that are still alive when it ends are
activations; everything else is a temporary.

Each storage also names the module that allocated it (``Timeline.module``): the innermost module
whose forward runs (global module hooks), in backward the module whose forward made the autograd
node running (``backward_modules.py``), in a recomputation the module recomputed.

The tracker is one dispatch mode; five of its parts are written beside it, each mixed into
``StorageTracker``: the module attribution (``module_attribution.py``), the block labels
(``block_labels.py``), the recording of a call's events for replay (``recording.py``), the
storages resized without an operator (``storage_resize.py``) and the folding of autograd's
out-of-place buffers into a plain run's in-place writes (``twin_folding.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.training import optimizer_state_tensors
from vramledger.record.timeline import Timeline
from vramledger.trace.core.backward_modules import BackwardModules
from vramledger.trace.core.block_labels import TIMED_PHASES, BlockLabels
from vramledger.trace.core.module_attribution import ModuleAttribution
from vramledger.trace.core.plain_branches import PlainBranches
from vramledger.trace.core.recording import Recordings
from vramledger.trace.core.storage_resize import StorageResizes
from vramledger.trace.core.twin_folding import TwinFolding
from vramledger.trace.core.values import (
    KNOWN_VALUE_CAP_BYTES,
    OPTIMIZER_KNOWN_VALUE_CAP_BYTES,
    KnownValues,
)
from vramledger.trace.core.wrapped_numbers import saved_wrapped_numbers, wrapped_numbers

OpObserver = Callable[[Any, tuple[Any, ...], dict[str, Any], Any, "StorageTracker"], None]
"""Called after each operator, before its outputs are recorded:
(func, args, kwargs, outputs, tracker).
It may add transient allocations (kernel scratch) or synthetic ones (library workspaces)."""


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``, looking inside wrapper subclasses (torchao's quantized
    optimizer states, DTensor) as ``torch.distributed._tools.common_utils`` does."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                out.extend(storages_of(inner))
        return out
    return [t.untyped_storage()]


_PLAIN_TYPES = frozenset({FakeTensor, torch.Tensor, torch.nn.Parameter})
_DEVICE_QUERY = torch.ops.prim.device.default


def _recorded_higher_order() -> list[Any]:
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    return [flex_attention, flex_attention_backward]


RECORDED_HIGHER_ORDER = _recorded_higher_order()
"""Higher-order operators a tracker records whole: FlexAttention's forward and backward
(torchtune attends with it where the GPU supports it). They run under the fake mode's rule,
which makes their outputs as the fused kernel does (it allocates nothing else); every other
higher-order operator is refused as PyTorch refuses it for a mode with no rule."""


def _through_higher_order_operators(cls: type) -> None:
    """Register :meth:`StorageTracker.run_higher_order` as ``cls``'s rule (by exact type, as
    ``HigherOrderOperator`` looks a mode's rule up) for every :data:`RECORDED_HIGHER_ORDER`."""
    for hop in RECORDED_HIGHER_ORDER:
        hop.py_impl(cls)(partial(_run_higher_order, hop))


def _run_higher_order(hop: Any, mode: Any, *args: Any, **kwargs: Any) -> Any:
    return mode.run_higher_order(hop, *args, **kwargs)


_OUTSIDE_ALLOCATOR: dict[int, Any] = {}
"""Storage ``_cdata`` -> a weak reference to it, for storages the device's caching allocator
never hands out (CUDA unified memory: ``paged_states.py``): no tracker records them."""


def mark_outside_allocator(t: torch.Tensor) -> None:
    """No tracker records ``t``'s storage (nor any view of it), for as long as it lives."""
    st = t.untyped_storage()
    key = st._cdata
    _OUTSIDE_ALLOCATOR[key] = weakref.ref(st, lambda _ref: _OUTSIDE_ALLOCATOR.pop(key, None))


class StorageTracker(
    BlockLabels, Recordings, ModuleAttribution, StorageResizes, TwinFolding, TorchDispatchMode
):
    """Record every storage allocation and free into a ``Timeline``.

    Use as a context manager *inside* a ``FakeTensorMode`` (or with real tensors), then call
    :meth:`close` to get the Timeline.
    """

    def __init__(
        self,
        *,
        module_names: dict[int, str] | None = None,
        op_observer: OpObserver | None = None,
        corrections: dict[Any, Callable[[Any, Any], Any]] | None = None,
        substitutes: dict[Any, Callable[..., Any]] | None = None,
        answer_optimizer_scalars: bool = False,
        scalar_answer: int = 1,
        blocks: dict[int, int] | None = None,
        tensor_blocks: dict[int, int] | None = None,
        device_type: str | None = None,
        op_categories: dict[str, Category] | None = None,
        resize_category: Category | None = None,
        values: KnownValues | None = None,
        plain_autograd: bool = True,
    ) -> None:
        super().__init__()
        self.timeline = Timeline()
        self.step = 0
        self.phase = Phase.SETUP
        self._live: dict[int, int] = {}  # StorageImpl address -> sid
        self._refs: dict[int, weakref.ref] = {}
        self._alive: set[int] = set()
        self._closed = False
        self._op_observer = op_observer
        self._module_names = module_names or {}
        self._module_stack: list[str | None] = []
        self._backward_modules = BackwardModules()
        self._region: list[int] | None = None  # sids allocated in the current forward/recompute
        self._recompute_depth: int | None = None
        self._hook_handles: list[Any] = []
        self._op: Any = None
        self._corrections = corrections or {}
        self._substitutes = substitutes or {}
        # Storages made by these operators, or brought to life by resize_ (FSDP2's unsharded
        # parameters), get these categories.
        self._op_categories = op_categories or {}
        self._resize_category = resize_category
        self._original_resize: Any = None
        # In a real run on a device, storages elsewhere (CPU step counters) are host memory.
        self._device_type = device_type
        self._answer_scalars = answer_optimizer_scalars
        self.scalar_answer = scalar_answer
        self.scalars_answered = 0
        # Block labels (see trace/core/blocks.py): id(block module) -> index; id(param) -> index.
        self._blocks = blocks or {}
        self._tensor_blocks = tensor_blocks or {}
        self._block: int | None = None  # the block running now (forward, backward)
        self._block_stack: list[int | None] = []
        self._inherit: Any = None  # block(s) the current op's outputs inherit (other phases)
        self._backward_end_pending = False  # no end-of-backward callback queued yet
        self._transients: list[int] = []  # kernel scratch of the current op, freed after it
        # Real values of tensors computed from the batch alone (trace/core/values.py).
        self.values = values
        if values is not None:
            values.module = lambda: self.current_module
        # Autograd's out-of-place branches for subclasses / under a mode (trace/core/plain_autograd.py):
        # the call just made whose first operand, if it dies at once, a plain run wrote into:
        # (operand's storage key, output's storage key, output's sid, its allocation event).
        self._plain_autograd = plain_autograd
        self.plain_branches = PlainBranches(values)
        """Formulas written in place as a chain, and ``prod``'s value-dependent backward."""
        self._shared: dict[int, int] = {}  # sid -> how many live storages are that buffer
        self._twin: tuple[int, int, int, int, Any] | None = None
        # A twin whose operand died at once but whose fold waits for the next operator
        # (plain_autograd.CONFIRMED_TWINS): the twin, the operand's sid, its free event.
        self._confirm: tuple[int, int, int, int, Any, int, int] | None = None
        # The output of the last call given a Python number for a Tensor argument, whose
        # autograd node (attached after the call) may keep it (trace/core/wrapped_numbers.py).
        self._wrapped_out: tuple[weakref.ref[torch.Tensor], list[str]] | None = None
        self.twins_merged = 0
        """How many out-of-place autograd buffers were modelled as the plain run's in-place
        writes."""
        self.higher_order_calls: dict[str, int] = {}
        """Higher-order operators recorded whole (:data:`RECORDED_HIGHER_ORDER`): name -> calls."""
        self.failure: tuple[BaseException, str] | None = None
        self._module_failure: tuple[BaseException, str] | None = None
        """The last exception an operator raised and the innermost module running then."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _through_higher_order_operators(cls)

    def run_higher_order(self, hop: Any, *args: Any, **kwargs: Any) -> Any:
        """A higher-order operator of :data:`RECORDED_HIGHER_ORDER` (with this mode popped):
        it runs under the modes below, and its outputs are recorded."""
        out = hop(*args, **kwargs)
        self.higher_order_calls[hop.name()] = self.higher_order_calls.get(hop.name(), 0) + 1
        self._twin = None
        self._see_output(hop, args, kwargs, out)
        return out

    # -- the dispatch hook -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            # a fake tensor answers C++'s ``tensor.device()`` through the mode: no kernel runs
            # and nothing is allocated (a real tensor never asks), so it neither ends a twin's
            # "dies at once" window nor stands between a twin and its confirming operator
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if self._confirm is not None:
            self._confirm_twin(func, args)
        if self._wrapped_out is not None:
            self._see_wrapped_numbers()
        self._twin = None
        for t in types:
            if t not in _PLAIN_TYPES and is_traceable_wrapper_subclass_type(t):
                # Let tensor subclasses (DTensor, torchao's quantized states) run first: their
                # inner operators then come back through this mode and are seen.
                return NotImplemented
        substitute = self._substitutes.get(func)
        run = func if substitute is None else partial(substitute, func)
        try:
            if self.values is None:
                out = run(*args, **kwargs)
            else:
                out = self.values.call(func, args, kwargs, run)
        except Exception as exc:
            if self._answers(func, exc):
                return self._scalar_answer(args)
            self._note_failure(exc)
            raise
        correct = self._corrections.get(func)
        if correct is not None:
            out = correct(args, out)
        self._op = func
        if self._blocks and self.phase not in TIMED_PHASES:
            self._inherit = self._inherited_blocks(args, out)
        if self._op_observer is not None:
            self._op_observer(func, args, kwargs, out, self)
        if self.values is not None and self.values.pending_scratch:
            self._add_mask_scratch(func)
        self._see_output(func, args, kwargs, out)
        if (
            isinstance(out, torch.Tensor)
            and torch.is_grad_enabled()
            and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        ):
            wrapped = wrapped_numbers(func, args)
            if wrapped:
                self._wrapped_out = (weakref.ref(out), [name for name, _ in wrapped])
        self._op = None
        self._inherit = None
        if self._transients:
            for sid in self._transients:
                self._free(sid)
            self._transients = []
        if self.plain_branches.replay:
            self._replay_plain()
        return out

    def _scalar_answer(self, args: tuple[Any, ...]) -> Any:
        """What a scalar read the tracker answers (:meth:`_answers`) returns."""
        self.scalars_answered += 1
        answer = self.scalar_answer
        return float(answer) if args[0].dtype.is_floating_point else answer

    def _add_mask_scratch(self, func: Any) -> None:
        """The index tensors the known values' kernel made from boolean masks
        (``values.pending_scratch``), scratch of the current operator."""
        self.add_transient(
            self.values.pending_scratch,
            f"{func} index tensors from boolean masks",
            Category.TEMPORARIES,
        )
        self.values.pending_scratch = 0

    def _see_wrapped_numbers(self) -> None:
        """Register the Python numbers the last call's autograd node saved as tensors."""
        ref, names = self._wrapped_out  # type: ignore[misc]
        self._wrapped_out = None
        out = ref()
        if out is not None:
            for saved in saved_wrapped_numbers(out, names, self._live.__contains__):
                self._see(saved)

    def _replay_plain(self) -> None:
        """Run and record the plain run's operators in place of the hidden ones
        (``plain_branches.PlainBranches.replay``)."""
        branches = self.plain_branches
        replay, branches.replay = branches.replay, []
        for func, args in replay:
            call_args = args()
            types = tuple({type(a) for a in call_args if isinstance(a, torch.Tensor)})
            branches.held.append(self.__torch_dispatch__(func, types, call_args))

    def _see_all(self, outs: Iterable[Any]) -> None:
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                self._see(o, i)
            elif isinstance(o, (tuple, list)):
                self._see_all(o)

    def _see(self, t: torch.Tensor, index: int = 0) -> list[int]:
        if t.device.type == "meta":  # shapes only, no memory (DeepSpeed keeps meta copies)
            return []
        sids = []
        for st in storages_of(t):
            key = st._cdata
            if key in _OUTSIDE_ALLOCATOR:
                continue
            sid = self._live.get(key)
            if sid is None:
                nbytes = st.nbytes()
                if nbytes == 0:
                    continue
                sid = self._new(nbytes, self._block_for(t, index))
                if self._device_type is not None and st.device.type != self._device_type:
                    self.timeline.on_host[sid] = True
                if self._op is not None and self._op_categories:
                    category = self._op_categories.get(str(self._op))
                    if category is not None:
                        self.timeline.tag(sid, category)
                self._live[key] = sid
                self._refs[key] = weakref.ref(st, partial(self._on_free, key))
            sids.append(sid)
        return sids

    def _new(self, nbytes: int, block: int | None = None) -> int:
        module, recomputed = self._allocating_module()
        op = str(self._op) if self._op is not None else None
        sid = self.timeline.new_storage(
            nbytes, self.step, self.phase, module, op, block, recomputed=recomputed
        )
        self._alive.add(sid)
        if self._region is not None:
            self._region.append(sid)
        return sid

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        self.plain_branches.forget(key)
        twin = self._twin
        if twin is not None and twin[0] == key and not self._closed:
            if twin[4] is None:
                self._merge_twin()
                return
            self._twin = None
        else:
            twin = None
        sid = self._live.pop(key, None)
        self._refs.pop(key, None)
        if sid is None or self._closed:
            return
        shared = self._shared.get(sid)
        if shared is not None:  # a chain's buffer: freed with its last storage
            if shared > 2:
                self._shared[sid] = shared - 1
            else:
                del self._shared[sid]
            return
        self._free(sid)
        if twin is not None:  # the fold waits for the next operator
            self._confirm = (*twin, sid, len(self.timeline.events) - 1)

    def _free(self, sid: int) -> None:
        self._alive.discard(sid)
        if self._blocks and self.phase not in TIMED_PHASES:
            self.timeline.free(sid, self.timeline.block[sid])
        else:
            self.timeline.free(sid, self._block)

    # -- what the training loop tells the tracker -----------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor | None], category: Category) -> None:
        """Register (if new) and tag the storages of ``tensors``."""
        self._twin = None
        for t in tensors:
            if t is None:
                continue
            for sid in self._see(t):
                self.timeline.tag(sid, category)

    def add_synthetic(self, nbytes: int, label: str, category: Category) -> int:
        """Record an allocation that no tensor shows (a library workspace); kept to the end."""
        self._twin = None
        block = self._block if self.phase in TIMED_PHASES else None
        sid = self._new(nbytes, block if self._blocks else None)
        self.timeline.labels[sid] = label
        self.timeline.tag(sid, category)
        return sid

    def add_transient(
        self, nbytes: int, label: str, category: Category = Category.WORKSPACE
    ) -> None:
        """Scratch memory the current operator's kernel holds while it runs (alongside its
        outputs) and frees before returning."""
        if nbytes <= 0:
            return
        sid = self.add_synthetic(nbytes, label, category)
        self._transients.append(sid)

    def mark_host(self, tensors: Iterable[torch.Tensor]) -> None:
        """The target keeps these storages in host memory, not on the device."""
        for t in tensors:
            for sid in self._see(t):
                self.timeline.on_host[sid] = True

    def set_phase(self, step: int, phase: Phase) -> None:
        self._twin = None
        if self._wrapped_out is not None:  # the forward's last call, before its region ends
            self._see_wrapped_numbers()
        if self.phase is Phase.FORWARD:
            self._end_region()
        self.step, self.phase = step, phase
        self.timeline.mark(step, phase)
        if self.values is not None:
            self.values.cap = (
                OPTIMIZER_KNOWN_VALUE_CAP_BYTES
                if phase is Phase.OPTIMIZER
                else KNOWN_VALUE_CAP_BYTES
            )
        if phase is Phase.FORWARD:
            self._region = []
            # A step's forward starts outside every block (so does the end of a backward,
            # ``_block_backward``; this holds if a backward ran no block hook).
            self._block, self._block_stack = None, []
        self._backward_end_pending = phase is Phase.BACKWARD

    def _end_region(self) -> None:
        region, self._region = self._region, None
        for sid in region or ():
            if sid in self._alive:
                self.timeline.tag(sid, Category.ACTIVATIONS)

    def _answers(self, func: Any, exc: Exception) -> bool:
        """Fake tensors hold no values; inside ``optimizer.step()`` a scalar read with ``.item()``
        (ASGD's step, eta and mu) only feeds arithmetic, never a shape, so it is answered."""
        from torch._subclasses.fake_tensor import DataDependentOutputException

        return (
            self._answer_scalars
            and self.phase is Phase.OPTIMIZER
            and func is torch.ops.aten._local_scalar_dense.default
            and isinstance(exc, DataDependentOutputException)
        )

    # -- context management ----------------------------------------------------------------------
    def __enter__(self) -> StorageTracker:
        self._patch_resize()
        self._backward_modules.bind()
        self._hook_handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward),
            torch.nn.modules.module.register_module_forward_hook(
                self._post_forward, always_call=True
            ),
        ]
        if self._plain_autograd:
            self.plain_branches.linear_calls.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._restore_resize()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        out = super().__exit__(*exc)
        if self._plain_autograd:
            self.plain_branches.linear_calls.__exit__(*exc)
        return out

    def close(self) -> Timeline:
        """Stop recording (later frees are ignored) and return the Timeline."""
        if self.phase is Phase.FORWARD:
            self._end_region()
        self._closed = True
        return self.timeline


class TrackerObserver:
    """Feeds what the training loop knows (phases, gradients, optimizer state) to a tracker."""

    def __init__(
        self,
        tracker: StorageTracker,
        host_resident: Callable[[torch.optim.Optimizer], list[torch.Tensor]] | None = None,
    ) -> None:
        self.tracker = tracker
        self.host_resident = host_resident

    def phase(self, step: int, phase: Phase) -> None:
        self.tracker.set_phase(step, phase)

    def tensors(self, tensors: Iterable[torch.Tensor | None], category: Category) -> None:
        self.tracker.track(tensors, category)

    def label(self, tensors: Iterable[torch.Tensor], text: str) -> None:
        for t in tensors:
            for sid in self.tracker._see(t):
                self.tracker.timeline.labels.setdefault(sid, text)

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        roles = getattr(optimizer, "memory_roles", None)
        if roles is not None:  # a stand-in that knows what its tensors are
            for category, tensors in roles().items():
                self.tracker.track(tensors, category)
        else:
            self.tracker.track(optimizer_state_tensors(optimizer), Category.OPTIMIZER_STATE)
        host = list(self.host_resident(optimizer)) if self.host_resident is not None else []
        host += getattr(optimizer, "host_tensors", list)()
        self.tracker.mark_host(host)


_through_higher_order_operators(StorageTracker)
