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
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

from ..categories import Category, Phase
from ..timeline import Timeline
from ..training import optimizer_state_tensors
from .backward_modules import BackwardModules
from .plain_autograd import (
    CONFIRMED_TWINS,
    IN_PLACE_TWINS,
    INPUT_BUFFER_SUM,
    Action,
    PlainBranches,
    confirming_operator,
    plain_writes_in_place,
)
from .values import KNOWN_VALUE_CAP_BYTES, OPTIMIZER_KNOWN_VALUE_CAP_BYTES, KnownValues
from .wrapped_numbers import saved_wrapped_numbers, wrapped_numbers


@dataclass(frozen=True)
class Recording:
    """The events of one call, relative to where they began (``StorageTracker.recording``):
    ``storages`` as (bytes, category, on host, module, recomputed, operator, block, block is the
    call's, label); ``events`` as (relative ``sid`` or ``~sid``, event block, event block is the
    call's)."""

    storages: list[tuple[Any, ...]]
    events: list[tuple[int, int | None, bool]]


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


_TIMED_PHASES = (Phase.FORWARD, Phase.BACKWARD)
_TWIN_OPS = frozenset({INPUT_BUFFER_SUM}.union(*IN_PLACE_TWINS.values()))
_PLAIN_TYPES = frozenset({FakeTensor, torch.Tensor, torch.nn.Parameter})
_DEVICE_QUERY = torch.ops.prim.device.default


def _grad_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _grad_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _grad_tensors(v)


def _identity(exc: BaseException) -> tuple[int, str]:
    return id(exc), f"{type(exc).__name__}: {exc}"


class StorageTracker(TorchDispatchMode):
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
        # Block labels (see trace/blocks.py): id(block module) -> index; id(param) -> index.
        self._blocks = blocks or {}
        self._tensor_blocks = tensor_blocks or {}
        self._block: int | None = None  # the block running now (forward, backward)
        self._block_stack: list[int | None] = []
        self._inherit: Any = None  # block(s) the current op's outputs inherit (other phases)
        self._backward_end_pending = False  # no end-of-backward callback queued yet
        self._transients: list[int] = []  # kernel scratch of the current op, freed after it
        # Real values of tensors computed from the batch alone (trace/values.py).
        self.values = values
        if values is not None:
            values.module = lambda: self.current_module
        # Autograd's out-of-place branches for subclasses / under a mode (trace/plain_autograd.py):
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
        # autograd node (attached after the call) may keep it (trace/wrapped_numbers.py).
        self._wrapped_out: tuple[weakref.ref[torch.Tensor], list[str]] | None = None
        self.twins_merged = 0
        """How many out-of-place autograd buffers were modelled as the plain run's in-place
        writes."""
        self.failure: tuple[BaseException, str] | None = None
        self._module_failure: tuple[BaseException, str] | None = None
        """The last exception an operator raised and the innermost module running then."""

    # -- the dispatch hook -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            # a fake tensor answers C++'s ``tensor.device()`` through the mode: no kernel runs
            # and nothing is allocated (a real tensor never asks), so it neither ends a twin's
            # "dies at once" window nor stands between a twin and its confirming operator
            return func(*args, **(kwargs or {}))
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
                out = run(*args, **(kwargs or {}))
            else:
                out = self.values.call(func, args, kwargs or {}, run)
        except Exception as exc:
            if self._answers(func, exc):
                self.scalars_answered += 1
                answer = self.scalar_answer
                return float(answer) if args[0].dtype.is_floating_point else answer
            module = self.current_module or self._backward_modules.running()[1]
            self.failure = (_identity(exc), module or "")
            raise
        correct = self._corrections.get(func)
        if correct is not None:
            out = correct(args, out)
        self._op = func
        if self._blocks and self.phase not in _TIMED_PHASES:
            self._inherit = self._inherited_blocks(args, out)
        if self._op_observer is not None:
            self._op_observer(func, args, kwargs or {}, out, self)
        if self.values is not None and self.values.pending_scratch:
            self.add_transient(
                self.values.pending_scratch,
                f"{func} index tensors from boolean masks",
                Category.TEMPORARIES,
            )
            self.values.pending_scratch = 0
        plain = None
        if self._plain_autograd and isinstance(out, torch.Tensor):
            plain = self.plain_branches.action(func, args, out)
        if plain is Action.HIDE and out.untyped_storage()._cdata not in self._live:
            self.plain_branches.hide(out.untyped_storage())
        elif plain is Action.ALIAS and self._alias(args[0], out):
            pass
        elif isinstance(out, torch.Tensor):
            if plain is Action.PROD_OUTPUT:
                self._prod_output(out)
            else:
                twin = (
                    self._plain_autograd
                    and func in _TWIN_OPS
                    and plain_writes_in_place(func, args, out)
                )
                confirm = (
                    confirming_operator(func, args, kwargs or {}, out)
                    if self._plain_autograd and not twin and func in CONFIRMED_TWINS
                    else None
                )
                first_event = len(self.timeline.events)
                self._see(out)
                if twin or confirm is not None:
                    self._note_twin(args[0], out, first_event, confirm)
        elif isinstance(out, (tuple, list)):
            self._see_all(out)
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
        (``plain_autograd.PlainBranches.replay``)."""
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

    def _note_twin(
        self, operand: torch.Tensor, out: torch.Tensor, event: int, confirm: Any = None
    ) -> None:
        """Remember a call whose plain twin writes ``out`` into ``operand``
        (``plain_autograd.plain_writes_in_place``), if ``out`` was a new storage. ``confirm``:
        the operator that must run next, on ``out``, for the fold to hold
        (``plain_autograd.CONFIRMED_TWINS``)."""
        tl = self.timeline
        if is_traceable_wrapper_subclass(operand) or is_traceable_wrapper_subclass(out):
            return
        operand_key = operand.untyped_storage()._cdata
        out_key = out.untyped_storage()._cdata
        out_sid = tl.num_storages - 1
        if (
            operand_key in self._live
            and self._live.get(out_key) == out_sid
            and event < len(tl.events)
            and tl.events[event] == out_sid
        ):
            self._twin = (operand_key, out_key, out_sid, event, confirm)

    def _alias(self, operand: torch.Tensor, out: torch.Tensor) -> bool:
        """``out`` is written into ``operand``'s buffer in a plain run (a chain link,
        ``plain_autograd.CHAINS``): both storages stand for one buffer, freed with the last."""
        if is_traceable_wrapper_subclass(operand) or is_traceable_wrapper_subclass(out):
            return False
        sid = self._live.get(operand.untyped_storage()._cdata)
        st = out.untyped_storage()
        key = st._cdata
        if sid is None or key in self._live:
            return False
        self._live[key] = sid
        self._refs[key] = weakref.ref(st, partial(self._on_free, key))
        self._shared[sid] = self._shared.get(sid, 1) + 1
        return True

    def _prod_output(self, out: torch.Tensor) -> None:
        """``prod_backward``'s result, recorded between the buffers of the plain no-zero
        branch (``plain_autograd.ProdPlainBranch``): the mask and the per-slice zero counts
        (locals), the scalar total (a temporary), the quotient ``result / input``."""
        branch = self.plain_branches.prod
        assert branch is not None
        label = "prod backward, no-zero branch: "
        temporaries = Category.TEMPORARIES
        mask = self.add_synthetic(branch.mask_bytes, label + "input == 0", temporaries)
        if not branch.mask_lives_to_return:  # (input == 0).nonzero(): the mask is a temporary
            self._free(mask)
        counts = None
        if branch.count_bytes:
            counts = self.add_synthetic(branch.count_bytes, label + "zero counts", temporaries)
            total = self.add_synthetic(branch.total_bytes, label + "total zeros", temporaries)
            self._free(total)
        quotient = self.add_synthetic(branch.quotient_bytes, label + "result / input", temporaries)
        self._see(out)
        self._free(quotient)
        if counts is not None:
            self._free(counts)
        if branch.mask_lives_to_return:
            self._free(mask)

    def _merge_twin(self) -> None:
        """The operand of the last call died at once: the plain run wrote the output into it.
        The output's storage becomes the operand's (one sid, never freed here) and the output's
        own allocation is taken back out of the timeline."""
        operand_key, out_key, out_sid, event, _ = self._twin  # type: ignore[misc]
        self._twin = None
        operand_sid = self._live.pop(operand_key)
        self._refs.pop(operand_key, None)
        self._fold(out_key, out_sid, event, operand_sid)

    def _confirm_twin(self, func: Any, args: tuple[Any, ...]) -> None:
        """The operator after a twin that waits for confirmation: when it is the confirming
        operator, run on the twin's output, and nothing but the operand's free was recorded
        since, the plain run wrote the output into the operand: the operand's free is taken
        back out and the output folded into it as ``_merge_twin`` does."""
        _, out_key, out_sid, event, confirm, operand_sid, free_event = self._confirm  # type: ignore[misc]
        self._confirm = None
        tl = self.timeline
        if (
            func is not confirm
            or not args
            or not isinstance(args[0], torch.Tensor)
            or args[0].untyped_storage()._cdata != out_key
            or self._live.get(out_key) != out_sid
            or tl.num_storages - 1 != out_sid
            or free_event != len(tl.events) - 1
            or tl.events[free_event] != ~operand_sid
            or (tl.marks and tl.marks[-1][0] > event)
        ):
            return
        del tl.events[free_event]
        del tl.event_block[free_event]
        self._alive.add(operand_sid)
        self._fold(out_key, out_sid, event, operand_sid)

    def _fold(self, out_key: int, out_sid: int, event: int, operand_sid: int) -> None:
        """``out``'s storage becomes ``operand_sid`` and its allocation leaves the timeline."""
        tl = self.timeline
        del tl.events[event]
        del tl.event_block[event]
        for column in (
            tl.nbytes,
            tl.tags,
            tl.on_host,
            tl.module,
            tl.recomputed,
            tl.op,
            tl.origin,
            tl.block,
        ):
            column.pop()
        tl.labels.pop(out_sid, None)
        self._alive.discard(out_sid)
        if self._region and self._region[-1] == out_sid:
            self._region.pop()
        self._live[out_key] = operand_sid
        self.twins_merged += 1

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

    def _resize(self, storage: torch.UntypedStorage, size: int) -> Any:
        """``UntypedStorage.resize_`` frees or allocates memory without an operator (FSDP2)."""
        self._twin = None
        result = self._original_resize(storage, size)
        if self._closed:
            return result
        key = storage._cdata
        old = self._live.get(key)
        if old is not None:
            if self.timeline.nbytes[old] == storage.nbytes():
                return result
            self._free(old)
            del self._live[key]
        if storage.nbytes() > 0:
            sid = self._new(storage.nbytes(), self._block if self._blocks else None)
            if old is not None:
                self.timeline.tags[sid] = self.timeline.tags[old]
                self.timeline.on_host[sid] = self.timeline.on_host[old]
            elif self._resize_category is not None:
                self.timeline.tag(sid, self._resize_category)
            self._live[key] = sid
            if key not in self._refs:
                self._refs[key] = weakref.ref(storage, partial(self._on_free, key))
        return result

    def _free(self, sid: int) -> None:
        self._alive.discard(sid)
        if self._blocks and self.phase not in _TIMED_PHASES:
            self.timeline.free(sid, self.timeline.block[sid])
        else:
            self.timeline.free(sid, self._block)

    # -- block labels (trace/blocks.py) ------------------------------------------------------------
    def _block_for(self, t: torch.Tensor, index: int) -> int | None:
        """Forward and backward: the block running now. Other phases: the block of the tensor
        (a parameter's), or of the operator's corresponding input."""
        if not self._blocks:
            return None
        if self.phase in _TIMED_PHASES:
            return self._block
        known = self._tensor_blocks.get(id(t))
        if known is not None:
            return known
        inherit = self._inherit
        if isinstance(inherit, list):
            return inherit[index] if index < len(inherit) else None
        return inherit

    def _storage_block(self, t: Any) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        sid = (
            self._live.get(t.untyped_storage()._cdata)
            if not is_traceable_wrapper_subclass(t)
            else None
        )
        return self.timeline.block[sid] if sid is not None else self._tensor_blocks.get(id(t))

    def _inherited_blocks(self, args: tuple[Any, ...], out: Any) -> Any:
        first = args[0] if args else None
        if (
            isinstance(out, (list, tuple))
            and isinstance(first, (list, tuple))
            and len(first) == len(out)
        ):
            return [self._storage_block(t) for t in first]  # foreach: output i from input i
        for a in args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                block = self._storage_block(t)
                if block is not None:
                    return block
        return None

    def _block_pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        k = self._blocks[id(module)]
        self._block_stack.append(self._block)
        self._block = k
        if self.phase is Phase.FORWARD:
            for t in _grad_tensors((args, kwargs)):
                t.register_hook(partial(self._block_backward, k - 1 if k > 0 else None))

    def _block_post_forward(self, module: torch.nn.Module, _args: Any, out: Any) -> None:
        k = self._blocks[id(module)]
        self._block = self._block_stack.pop() if self._block_stack else None
        if self.phase is Phase.FORWARD:
            for t in _grad_tensors(out):
                t.register_hook(partial(self._block_backward, k))

    def _block_backward(self, k: int | None, _grad: torch.Tensor) -> None:
        self._block = k
        if self._backward_end_pending:
            # The first block hook of a backward runs in its outermost graph task: when that
            # task ends, no block runs. Block 0's input hook says so only when the input needs a
            # gradient; under LoRA, QLoRA or a frozen embedding it does not, and the release of
            # the graph after backward (saved tensors of every block) would be labelled block 0.
            self._backward_end_pending = False
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._block = None

    # -- recording a call's events to replay it (trace/step_memo.py) ----------------------------
    def position(self) -> tuple[int, int, int]:
        """Where the timeline is now (events, storages, marks): the start of a recording."""
        self._twin = None  # no fold across a recording's edge (it would move its events)
        self._confirm = None
        tl = self.timeline
        return len(tl.events), tl.num_storages, len(tl.marks)

    def recording(self, start: tuple[int, int, int], block: int | None) -> Recording | None:
        """The events since ``start``, if they are self-contained: every storage they allocate
        is freed among them and they touch no other (and no phase began). ``block``: the block
        label the call ran for, which a replay replaces with its own."""
        first_event, first_sid, marks = start
        tl = self.timeline
        if len(tl.marks) != marks:
            return None
        events: list[tuple[int, int | None, bool]] = []
        live: set[int] = set()
        for e, event_block in zip(
            tl.events[first_event:], tl.event_block[first_event:], strict=True
        ):
            sid = e if e >= 0 else ~e
            if sid < first_sid or (e < 0 and sid not in live):
                return None
            (live.add if e >= 0 else live.discard)(sid)
            same = block is not None and event_block == block
            events.append((e - first_sid if e >= 0 else ~(sid - first_sid), event_block, same))
        if live:
            return None
        sids = range(first_sid, tl.num_storages)
        return Recording(
            events=events,
            storages=[
                (
                    tl.nbytes[s],
                    tl.tags[s],
                    tl.on_host[s],
                    tl.module[s],
                    tl.recomputed[s],
                    tl.op[s],
                    tl.block[s],
                    block is not None and tl.block[s] == block,
                    tl.labels.get(s),
                )
                for s in sids
            ],
        )

    def replay(self, recording: Recording, block: int | None) -> None:
        """Append a recording's events again, for a call that would make exactly them, its
        block labels made ``block``'s."""
        self._twin = None
        self._confirm = None
        tl = self.timeline
        base = tl.num_storages
        for nbytes, tag, on_host, module, again, op, own_block, same, label in recording.storages:
            sid = tl.add_storage(nbytes, tag or Category.TEMPORARIES)
            tl.tags[sid] = tag
            tl.on_host[sid] = on_host
            tl.module[sid] = module
            tl.recomputed[sid] = again
            tl.op[sid] = op
            tl.origin[sid] = (self.step, self.phase)
            tl.block[sid] = block if same else own_block
            if label is not None:
                tl.labels[sid] = label
        for e, event_block, same in recording.events:
            tl.events.append(e + base if e >= 0 else ~(~e + base))
            tl.event_block.append(block if same else event_block)

    def block_of(self, t: Any) -> int | None:
        """The block label of the storage behind ``t`` (inside a wrapper subclass, its first
        plain tensor's)."""
        while isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            if not attrs:
                return None
            t = getattr(t, attrs[0])
        return self._storage_block(t)

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
        block = self._block if self.phase in _TIMED_PHASES else None
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

    # -- module attribution and recomputation ------------------------------------------------------
    def _allocating_module(self) -> tuple[str | None, bool]:
        """(module, recomputed) of an allocation now: in a forward (or its recomputation under
        activation checkpointing) the innermost module running; in backward the module whose
        forward made the autograd node running (``backward_modules.py``)."""
        stack = self._module_stack
        if self._recompute_depth is not None:
            return (stack[-1] if stack else None), True
        in_backward, module = self._backward_modules.running()
        if in_backward:
            return module, False
        return (stack[-1] if stack else None), False

    def _pre_forward(self, module: torch.nn.Module, _args: Any) -> None:
        name = self._module_names.get(id(module))
        if name is None and self._module_stack:
            name = self._module_stack[-1]
        if self.phase is Phase.BACKWARD and self._recompute_depth is None:
            # A module runs forward inside backward: activation checkpointing recomputes it.
            self._recompute_depth = len(self._module_stack)
            self._region = []
        self._module_stack.append(name)
        self._backward_modules.own(module, name)
        self._backward_modules.enter(name)

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

    @property
    def current_module(self) -> str | None:
        return self._module_stack[-1] if self._module_stack else None

    def module_of(self, exc: BaseException) -> str | None:
        """The module an escaping exception came from, if an operator or module raised it."""
        chain = {_identity(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None}
        for known in (self.failure, self._module_failure):
            if known is not None and known[0] in chain:
                return known[1]
        return None

    def _post_forward(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self._module_stack:
            name = self._module_stack.pop()
            exc = sys.exc_info()[1]
            if exc is not None:
                key = _identity(exc)
                if self._module_failure is None or self._module_failure[0] != key:
                    self._module_failure = (key, name or "")
            del exc
            self._backward_modules.enter(self.current_module)

        if self._recompute_depth is not None and len(self._module_stack) == self._recompute_depth:
            self._recompute_depth = None
            self._end_region()

    # -- context management ----------------------------------------------------------------------
    def __enter__(self) -> StorageTracker:
        if self._original_resize is None:
            self._original_resize = torch.UntypedStorage.resize_
            tracker = self

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                return tracker._resize(storage, size)

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
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

    def set_blocks(self, blocks: list[torch.nn.Module]) -> None:
        """Label events with ``blocks``' indices from now on (a program's model, whose blocks
        are known once it is built: ``trace/program_blocks.py``), as the ``blocks`` and
        ``tensor_blocks`` arguments do from the start."""
        self._blocks = {id(b): k for k, b in enumerate(blocks)}
        self._tensor_blocks = {id(p): k for k, b in enumerate(blocks) for p in b.parameters()}
        self.label_blocks(blocks)

    def label_blocks(self, modules: Iterable[torch.nn.Module]) -> None:
        """Hook the repeated blocks so every event is labelled with its block index."""
        for module in modules:
            self._hook_handles.append(  # before any other hook (FSDP's all-gather is the block's)
                module.register_forward_pre_hook(
                    self._block_pre_forward, with_kwargs=True, prepend=True
                )
            )
            self._hook_handles.append(
                module.register_forward_hook(self._block_post_forward, always_call=True)
            )

    def __exit__(self, *exc: Any) -> None:
        if self._original_resize is not None:
            torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
            self._original_resize = None
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
