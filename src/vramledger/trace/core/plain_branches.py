"""Autograd's plain-run branches that the twin rule of ``plain_autograd.py`` (an out-of-place
output folded into its operand when the operand dies at once) does not cover.

Three formulas need more than that rule (:class:`PlainBranches`, applied by the tracker):

- ``binary_cross_entropy_with_logits_backward`` with ``pos_weight`` writes a *chain* in place,
  ``t.add(1).sub_(target).mul_(input.sigmoid()).sub_(t)``: out of place, every link's operand
  is a temporary that lives to the end of the C++ full-expression, so it does not die at once.
  The chain starts at the ``add`` (``t`` itself is a named local that lives on) and each later
  ``sub``/``mul`` whose first operand is the chain's buffer is that buffer (:data:`CHAINS`).
- ``prod_backward`` (``ProdBackward0``/``1``) decides by value: a plain run computes
  ``grad * (result / input)`` when the input holds no zero, else ``prod_safe_zeros_backward``
  (``cat``/``cumprod``/``flip``), which is what every subclass or mode runs. The trace records
  the no-zero branch's allocations instead (:class:`ProdPlainBranch`) when the input's values
  say it holds no zero (a real run, or values the trace knows, trace/core/values.py) or are
  unknown (a fake tensor from parameters: assumed, as real training data nearly always is,
  and said in the notes with what the other branch would hold).
- ``cross_entropy`` with label smoothing, class weights and a mean sums the kept labels'
  weights in its forward composite by ``masked_select`` in a plain run, by ``masked_fill`` and
  ``gather`` for a subclass weight: the latter's buffers are hidden and the plain operators are
  run through the tracker in their place (``PlainBranches._weight_sum_action``), on the
  labels' values the trace knows (without them it is traced as the mode runs it).

One forward composite takes the out-of-place branch too: ``linear`` with a bias, when it
neither calls ``addmm`` (a 2-D input) nor flattens a contiguous input into one
(``_flatten_nd_linear``), computes ``output = at::matmul(input, weight.t())`` and then
``output.add_(bias)`` in a plain run, ``at::add(output, bias)`` for a subclass bias (any bias
under a mode) (aten/src/ATen/native/Linear.cpp). That happens for a non-contiguous input, as
``nn.MultiheadAttention`` gives its key and value projections (transposed). The dispatch-level
operators are those of Python's ``x @ w.t() + b``, which is out of place in a plain run too,
so the rule needs to know that ``linear`` is running: :class:`LinearCalls`, entered by the
tracker, keeps the bias of the call running.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vramledger.inputs.notes import Note, Topic
from vramledger.trace.core.plain_autograd import CHAINS, dense_like

aten = torch.ops.aten

_SMOOTHED_WEIGHT_SUM = frozenset(
    {
        aten.eq.Scalar,
        aten.masked_fill_.Scalar,
        aten.masked_fill.Scalar,
        aten.gather.default,
        aten.div.Tensor,
    }
)
"""The operators of ``cross_entropy``'s label-smoothing weight sum (see
``PlainBranches._weight_sum_action``)."""

LINEAR_BIAS_ADD = aten.add.Tensor
"""The operator ``linear``'s matmul branch adds the bias with for a subclass bias or under a
mode (``at::add(output, *bias)``); a plain run calls ``output.add_(*bias)``."""

PROD_BACKWARD = frozenset({"ProdBackward0", "ProdBackward1"})
"""``prod_backward`` over the whole tensor (0) and along a dimension (1), FunctionsManual.cpp."""


class LinearCalls:
    """The ``linear`` calls running now: for each, the bias a plain run adds in place (None:
    no bias, or a tensor subclass such as a DTensor, for which the plain run adds out of place
    as well). While entered, ``torch.nn.functional.linear`` (what ``nn.Linear`` and
    ``F.multi_head_attention_forward`` call) is a wrapper that keeps the bias of the running
    call; a torch-function mode would not do, since it does not see the calls inside a Python
    function that handles the torch function itself (``multi_head_attention_forward``).

    ``linear`` (aten/src/ATen/native/Linear.cpp) is a composite: a 2-D input with a bias runs
    ``addmm``; a contiguous input with a 1-D bias runs ``_flatten_nd_linear`` (``addmm`` on the
    flattened input); otherwise::

        auto output = at::matmul(input, weight.t());
        if (bias->defined()) {
          // for composite compliance use out-of-place version of `add`
          if (isTensorSubclassLike(*bias) || bias->_fw_grad(/*level*/ 0).defined()) {
            output = at::add(output, *bias);
          } else {
            output.add_(*bias);
          }
        }

    Not seen: code that bound ``linear`` before the tracker was entered
    (``from torch.nn.functional import linear`` at import) or calls ``torch._C._nn.linear``,
    and calls on other threads than the one that entered (the tracker is a thread-local
    dispatch mode; the patch is not); their bias adds stay out of place, as traced."""

    def __init__(self) -> None:
        self.biases: list[torch.Tensor | None] = []
        self._original: list[Any] = []

    def __enter__(self) -> LinearCalls:
        functional = torch.nn.functional
        original = functional.linear
        self._original.append(original)
        thread = threading.get_ident()

        def linear(input: Any, weight: Any, bias: Any = None) -> Any:
            # Inside a torch.compile'd region Inductor plans the bias add (and dynamo cannot
            # trace threading.get_ident); is_compiling() is a constant to dynamo
            if torch.compiler.is_compiling() or threading.get_ident() != thread:
                return original(input, weight, bias)
            plain = isinstance(bias, torch.Tensor) and not is_traceable_wrapper_subclass(bias)
            self.biases.append(bias if plain else None)
            try:
                return original(input, weight, bias)
            finally:
                self.biases.pop()

        functional.linear = linear
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.nn.functional.linear = self._original.pop()

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias of the innermost ``linear`` running now, if a plain run adds it in place."""
        return self.biases[-1] if self.biases else None


class Action(Enum):
    """What the tracker does with an operator's output to record the plain run instead."""

    ALIAS = "alias"
    """The output is ``args[0]``'s storage (a link of a chain written in place)."""
    HIDE = "hide"
    """Not allocated in a plain run (``prod_safe_zeros_backward``'s buffers): not recorded."""
    PROD_OUTPUT = "prod output"
    """``prod_backward``'s result: recorded between the no-zero branch's buffers."""


@dataclass(frozen=True)
class ProdPlainBranch:
    """The buffers the plain no-zero branch of one ``prod_backward`` call holds, in bytes.

    Along a dimension (``ProdBackward1``)::

        Tensor zero_mask = (input == 0);                        // bool, input's shape
        Tensor slice_zero_count = zero_mask.sum(dim, true);     // int64, reduced shape
        int64_t total_zeros = slice_zero_count.sum().item<int64_t>();  // int64 scalar, temporary
        return grad * (result / input).conj();                  // quotient: temporary

    Whole tensor (``ProdBackward0``): ``Tensor zero_idx = (input == 0).nonzero();`` (the mask
    is a temporary of that statement; no zero: ``zero_idx`` is empty), then the same return.
    The locals (``zero_mask``, ``slice_zero_count``) are freed after the result is made."""

    mask_bytes: int
    mask_lives_to_return: bool
    count_bytes: int
    total_bytes: int
    quotient_bytes: int

    @classmethod
    def of(cls, node: Any) -> ProdPlainBranch:
        inp, result = node._saved_self, node._saved_result
        quotient = inp.numel() * torch.promote_types(result.dtype, inp.dtype).itemsize
        mask = inp.numel() * torch.bool.itemsize
        if node.name() == "ProdBackward0":
            return cls(mask, False, 0, 0, quotient)
        dim = node._saved_dim
        if dim >= 2**63:  # the saved int64 reads back unsigned
            dim -= 2**64
        dim %= max(inp.dim(), 1)
        counts = inp.numel() // max(inp.shape[dim], 1) * torch.int64.itemsize
        return cls(mask, True, counts, torch.int64.itemsize, quotient)

    @property
    def peak_with(self) -> int:
        """Bytes the branch holds beside its result while the result is made."""
        mask = self.mask_bytes if self.mask_lives_to_return else 0
        return mask + self.count_bytes + self.quotient_bytes


def _readable(t: torch.Tensor, values: Any) -> bool:
    """Whether ``t``'s values exist for a value-dependent operator: a real tensor, or one whose
    values the trace knows."""
    if isinstance(t, FakeTensor):
        return values is not None and values.known(t)
    return t.device.type != "meta"


def holds_zero(t: torch.Tensor, values: Any = None) -> bool | None:
    """Whether ``t`` holds a zero: read from a real tensor, or from the values the trace knows
    (trace/core/values.py); ``None`` when unknown (a fake tensor computed from parameters)."""
    if isinstance(t, FakeTensor):
        if values is None or not values.known(t):
            return None
        t = values.value(t)
    if t.device.type == "meta":
        return None
    with no_dispatch():
        return bool((t == 0).any())


class PlainBranches:
    """Per-node state for the formulas of :data:`CHAINS` and :data:`PROD_BACKWARD`: which
    storages form the current chain, which buffers of the current ``prod_backward`` call are
    hidden, and what the trace assumed about ``prod``'s input (for the notes)."""

    def __init__(self, values: Any = None) -> None:
        self._values = values
        self._node: tuple[str, int] | None = None
        self._chain: set[int] = set()  # storage keys of the current chain's buffer
        self.prod: ProdPlainBranch | None = None
        """The no-zero branch of the ``prod_backward`` running now (None: not modelled)."""
        self.hidden: set[int] = set()  # storage keys of prod_safe_zeros_backward's buffers
        self.prod_assumed = 0
        """``prod_backward`` calls whose input values were unknown: no zero assumed."""
        self.prod_known = 0
        """``prod_backward`` calls whose input was seen to hold no zero."""
        self.prod_zeros = 0
        """``prod_backward`` calls whose input holds a zero: run as the plain run does."""
        self.zero_branch_extra = 0
        """The most bytes one assumed call's zero branch (as traced) held beyond the no-zero
        branch while it ran: what an input with a zero would add at that point."""
        self._hidden_live = 0
        self._hidden_peak = 0
        self._hidden_refs: dict[int, Any] = {}
        self._ignore: tuple[int, weakref.ref[torch.Tensor], bool] | None = None
        """(ignore mask's key, target, the smoothed loss was masked with it)"""
        self._filtered: tuple[int, weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]] | None = (
            None
        )
        self.replay: list[tuple[Any, Callable[[], tuple[Any, ...]]]] = []
        """Plain-run operators the tracker runs (and records) after the current one:
        (operator, its arguments when run); each output is appended to :attr:`held`."""
        self.held: list[torch.Tensor] = []
        """Outputs of replayed operators, alive until the plain statement ends."""
        self.linear_calls = LinearCalls()
        """The ``linear`` calls running now (entered by the tracker)."""

    def forget(self, key: int) -> None:
        """A storage died: its key may be reused by a new one."""
        self._chain.discard(key)

    def action(self, func: Any, args: tuple[Any, ...], out: torch.Tensor) -> Action | None:
        """How a plain run would have made ``out``, for the operators of these formulas (None:
        as traced, left to :func:`plain_writes_in_place`)."""
        if func is LINEAR_BIAS_ADD and self.linear_calls.bias is not None:
            return self._linear_bias_action(args, out)
        if func in _SMOOTHED_WEIGHT_SUM:
            return self._weight_sum_action(func, args, out)
        if torch.is_grad_enabled():
            return None
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        name = node.name()
        here = (name, node._sequence_nr())
        if here != self._node:
            self._start(here, node)
        if name in CHAINS:
            return self._chain_action(name, func, args, out)
        if name in PROD_BACKWARD and self.prod is not None:
            return self._prod_action(func, args, out)
        return None

    def _start(self, here: tuple[str, int], node: Any) -> None:
        self._node = here
        self._chain.clear()
        self.prod = None
        if here[0] not in PROD_BACKWARD:
            return
        inp = node._saved_self
        if inp.dim() == 0:
            return  # `return grad` on both branches
        zero = holds_zero(inp, self._values)
        if zero:
            self.prod_zeros += 1
            return
        self.prod = ProdPlainBranch.of(node)
        self.prod_assumed += zero is None
        self.prod_known += zero is False
        self._hidden_live = self._hidden_peak = 0

    def _weight_sum_action(
        self, func: Any, args: tuple[Any, ...], out: torch.Tensor
    ) -> Action | None:
        """``cross_entropy`` with label smoothing, class weights and a mean
        (``cross_entropy_loss_label_smoothing`` in aten/src/ATen/native/Loss.cpp) divides by
        the kept labels' weights. For a subclass weight (any weight under a mode)::

            auto ignore_mask = target == ignore_index;
            auto filtered_target = target.masked_fill(ignore_mask, 0);
            auto tgt_weights = weight.gather(0, filtered_target.flatten());
            auto weight_sum = tgt_weights.masked_fill_(ignore_mask.flatten(), 0).sum();
            ret = smooth_loss.sum() / weight_sum;

        and in a plain run::

            ret = smooth_loss.sum() / weight.gather(0, target.masked_select(~ignore_mask)
                                                       .flatten()).sum();

        The first two buffers are hidden and the plain operators are run in their place
        (:attr:`replay`, through the tracker, so that their kernels' scratch and the number
        of kept labels, known from the batch, count); they live to the division."""
        if func is aten.eq.Scalar:
            # weakly: remembering the operands must not keep them alive (an `eq` anywhere, the
            # labels' `== ignore_index` of every loss, would hold the labels to the next one)
            self._ignore = (out.untyped_storage()._cdata, weakref.ref(args[0]), False)
            return None
        if func is aten.masked_fill_.Scalar:  # smooth_loss.masked_fill_(ignore_mask, 0.0)
            mask = args[1]
            if (
                self._ignore is not None
                and isinstance(mask, torch.Tensor)
                and mask.untyped_storage()._cdata == self._ignore[0]
                and args[0].is_floating_point()
            ):
                self._ignore = (*self._ignore[:2], True)
            return None
        if func is aten.div.Tensor:
            self.held.clear()  # the plain statement's temporaries die with it
            return None
        if func is aten.masked_fill.Scalar:
            target, mask = args[0], args[1]
            if (
                self._ignore is not None
                and self._ignore[2]
                and target is self._ignore[1]()
                and isinstance(mask, torch.Tensor)
                and mask.untyped_storage()._cdata == self._ignore[0]
                and not target.is_floating_point()
                and _readable(target, self._values)
                and _readable(mask, self._values)
            ):
                self._filtered = (
                    out.untyped_storage()._cdata,
                    weakref.ref(target),
                    weakref.ref(mask),
                )
                return Action.HIDE
            return None
        # gather(weight, 0, filtered_target.flatten())
        index = args[2] if len(args) > 2 else None
        if (
            self._filtered is not None
            and args[1] == 0
            and isinstance(index, torch.Tensor)
            and index.untyped_storage()._cdata == self._filtered[0]
            and args[0].dim() == 1
        ):
            _, target_ref, mask_ref = self._filtered
            self._filtered = None
            target, mask = target_ref(), mask_ref()
            if target is None or mask is None:
                return None
            weight = args[0]
            self.replay = [
                (aten.bitwise_not.default, lambda: (mask,)),
                (aten.masked_select.default, lambda: (target, self.held[-1])),
                (aten.gather.default, lambda: (weight, 0, self.held[-1].flatten())),
            ]
            return Action.HIDE
        return None

    def _linear_bias_action(self, args: tuple[Any, ...], out: torch.Tensor) -> Action | None:
        """``linear``'s bias added to the matmul's output: in place in a plain run
        (:class:`LinearCalls`), so the output is the matmul's buffer. The bias reaches the
        operator as passed, or cast by autocast (a copy): matched by shape. ``add_`` keeps the
        output's dtype where ``add`` promotes: with dtypes that differ the traced output is
        not the plain one, and is left as traced."""
        bias = self.linear_calls.bias
        assert bias is not None
        operand, added = args[0], args[1] if len(args) > 1 else None
        if (
            isinstance(operand, torch.Tensor)
            and isinstance(added, torch.Tensor)
            and added.shape == bias.shape
            and operand.shape == out.shape
            and operand.dtype == out.dtype
            and operand.device == out.device
            and operand.layout is torch.strided
        ):
            return Action.ALIAS
        return None

    def _chain_action(
        self, name: str, func: Any, args: tuple[Any, ...], out: torch.Tensor
    ) -> Action | None:
        head, links = CHAINS[name]
        if func is head:
            self._chain.add(out.untyped_storage()._cdata)
            return None
        operand = args[0] if args else None
        if (
            func in links
            and isinstance(operand, torch.Tensor)
            and operand.untyped_storage()._cdata in self._chain
            and dense_like(operand, out)
        ):
            self._chain.add(out.untyped_storage()._cdata)
            return Action.ALIAS
        return None

    def _prod_action(self, func: Any, args: tuple[Any, ...], out: torch.Tensor) -> Action:
        operand = args[0] if args else None
        if (
            func is aten.mul.Tensor
            and isinstance(operand, torch.Tensor)
            and operand.untyped_storage()._cdata not in self.hidden
        ):
            # grad * (exclusive_normal * exclusive_reverse): the call's result
            assert self.prod is not None
            out_bytes = out.untyped_storage().nbytes()
            zero_branch = max(self._hidden_peak, self._hidden_live + out_bytes)
            if self.prod.mask_lives_to_return:  # the zero test's locals outlive either branch
                zero_branch += self.prod.mask_bytes + self.prod.count_bytes
            plain = self.prod.peak_with + out_bytes
            if self.prod_assumed:
                self.zero_branch_extra = max(self.zero_branch_extra, zero_branch - plain)
            return Action.PROD_OUTPUT
        return Action.HIDE

    def hide(self, storage: torch.UntypedStorage) -> None:
        """Keep ``storage`` out of the timeline, counting it for the zero branch's figure."""
        key = storage._cdata
        if key in self.hidden:
            return
        nbytes = storage.nbytes()
        self.hidden.add(key)
        self._hidden_live += nbytes
        self._hidden_peak = max(self._hidden_peak, self._hidden_live)

        def died(_ref: Any, key: int = key, nbytes: int = nbytes) -> None:
            self.hidden.discard(key)
            self._hidden_refs.pop(key, None)
            self._hidden_live -= nbytes

        self._hidden_refs[key] = weakref.ref(storage, died)

    def notes(self) -> list[str]:
        """What the trace assumed, derived from the ``prod_backward`` calls it ran."""
        if not self.prod_assumed:
            return []
        more = (
            f"with a zero, that call holds up to {self.zero_branch_extra:,} bytes more while it "
            "runs (prod_safe_zeros_backward)"
            if self.zero_branch_extra > 0
            else "with a zero, prod_safe_zeros_backward holds no more at that point"
        )
        return [
            Note(
                Topic.VALUES,
                f"prod backward ({self.prod_assumed} call{'s' * (self.prod_assumed != 1)} in the "
                "trace): assumed the input holds no zero (its values come from parameters, unknown to the trace), "
                f"so autograd computes grad * (result / input); {more}",
            )
        ]
