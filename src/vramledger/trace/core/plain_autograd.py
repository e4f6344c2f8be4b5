"""Where autograd allocates differently under a tracker than in a plain run, and the plain path.

PyTorch's autograd asks ``at::isTensorSubclassLike`` / ``at::areAnyTensorSubclassLike``
(aten/src/ATen/TensorSubclassLikeUtils.h) before writing into a buffer in place. Both answer
true whenever *any* ``TorchDispatchMode`` is active (``c10::impl::dispatch_mode_enabled()``) or
a tensor carries the Python or Meta key, as every ``FakeTensor`` does. A trace, and a real step
run under the storage tracker, therefore take the out-of-place branch, where a plain run writes
in place:

- autograd's input buffer sums two gradients for one tensor as ``old + new`` instead of
  ``old.add_(new)`` (``accumulate`` / ``can_accumulate_inplace`` in
  torch/csrc/autograd/input_buffer.cpp);
- backward formulas that start from a zero buffer and scatter into it
  (torch/csrc/autograd/FunctionsManual.cpp): ``index_backward`` runs ``index_put`` instead of
  ``_index_put_impl_``, ``gather_backward`` ``scatter_add`` instead of ``scatter_add_``,
  ``index_select_backward`` ``index_add`` instead of ``index_add_``,
  ``value_selecting_reduction_backward`` (max/min/sort/topk/kthvalue/mode/median along a
  dimension) ``scatter`` instead of ``scatter_``; ``binary_cross_entropy_with_logits_backward``
  with ``pos_weight`` chains ``sub``/``mul`` instead of ``sub_``/``mul_``.

Each out-of-place branch allocates a new buffer the size of its first operand, then drops the
operand; the in-place branch writes into the operand. So the plain run is recovered from the
traced one without knowing the kernels: when such an operator's first operand dies at once
(before anything else runs), the plain run had written into it, and the output *is* that
storage. The tracker applies that (``twin_folding.py``: ``_twin`` / ``_merge_twin``); this
module decides which calls qualify. ``docs/plain-run-paths.md`` lists every branch found, with
its source, and which are modelled; ``tests/test_plain_paths.py`` checks each modelled one
against a plain run counted by the allocator.

Three formulas, and one forward composite, need more than that rule: ``plain_branches.py``.

Not modelled (see the doc): forward-mode (jvp) formulas; double backward
(``create_graph=True``: autograd then always sums out of place, as the trace does).
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

INPUT_BUFFER_SUM = aten.add.Tensor
"""The operator autograd's input buffer sums two gradients with when it cannot do it in place
(``buffer[pos] = old_var + var`` in ``accumulate``, torch/csrc/autograd/input_buffer.cpp); a
plain run does ``old_var.add_(var)`` when ``can_accumulate_inplace(old_var)``: a plain dense
tensor whose last reference the buffer holds, and grad mode off."""

_VALUE_SELECTING = frozenset({aten.scatter.src})
"""``value_selecting_reduction_backward`` in FunctionsManual.cpp: ``grad_in.scatter_(dim,
indices, grad)`` on a zero buffer, ``scatter`` out of place for subclasses."""

IN_PLACE_TWINS: dict[str, frozenset[Any]] = {
    # index_backward: zeros_like_self.index_put(...) vs at::_index_put_impl_(zeros_like_self, ...)
    "IndexBackward0": frozenset({aten.index_put.default}),
    # gather_backward: result.scatter_add(...) vs result.scatter_add_(...)
    "GatherBackward0": frozenset({aten.scatter_add.default}),
    # index_select_backward: zeros.index_add(...) vs zeros.index_add_(...)
    "IndexSelectBackward0": frozenset({aten.index_add.default}),
    "MaxBackward0": _VALUE_SELECTING,
    "MinBackward0": _VALUE_SELECTING,
    "SortBackward0": _VALUE_SELECTING,
    "SortBackward1": _VALUE_SELECTING,
    "TopkBackward0": _VALUE_SELECTING,
    "KthvalueBackward0": _VALUE_SELECTING,
    "ModeBackward0": _VALUE_SELECTING,
    "MedianBackward1": _VALUE_SELECTING,
    "NanmedianBackward1": _VALUE_SELECTING,
    # binary_cross_entropy_with_logits_backward with pos_weight:
    # t.add(1).sub(target).mul(input.sigmoid()).sub(t) vs ...sub_(target).mul_(...).sub_(t)
    "BinaryCrossEntropyWithLogitsBackward0": frozenset({aten.sub.Tensor, aten.mul.Tensor}),
}
"""Backward nodes whose formula takes an out-of-place branch for subclasses (or under a
dispatch mode) where a plain run writes into a fresh buffer in place: node name -> the
out-of-place operators."""


def dense_like(operand: Any, out: Any) -> bool:
    """The in-place twin writes ``out`` into ``operand``: same shape and dtype, a layout the
    in-place kernel keeps (non-overlapping and dense, as ``can_accumulate_inplace`` asks), and
    not a view. A view holds its base, so its storage has two owners
    (``v.storage().use_count() == 1`` fails) even when the view is the base's last user and
    both die at once: the plain input buffer then sums out of place too. Seen on GPT-2's tied
    embedding: ``MmBackward0`` gives the output projection's gradient as a transposed view,
    and the embedding's gradient is added to it with ``old + new`` in a plain run."""
    if not isinstance(operand, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if operand._is_view():
        return False
    if operand.shape != out.shape or operand.dtype != out.dtype:
        return False
    if operand.device != out.device or operand.layout is not torch.strided:
        return False
    return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(operand))


def plain_writes_in_place(func: Any, args: tuple[Any, ...], out: Any) -> bool:
    """Whether a plain run would have written this call's output into ``args[0]``, provided
    ``args[0]`` dies as soon as the call returns (the tracker checks that part: it is the
    plain branch's "last reference" condition)."""
    if torch.is_grad_enabled() or not args:
        return False  # create_graph=True: autograd sums out of place in a plain run too
    node = torch._C._current_autograd_node()
    if node is None:
        return False
    if func is not INPUT_BUFFER_SUM and func not in IN_PLACE_TWINS.get(node.name(), ()):
        return False
    return dense_like(args[0], out)


CONFIRMED_TWINS: dict[Any, Any] = {aten.add.Tensor: aten._safe_softmax.default}
"""Forward composites that write into a fresh buffer in place in a plain run, out of place
for subclasses or under a mode, recognised by the operator that follows: out-of-place operator
-> the operator that must come next, on its output. ``_scaled_dot_product_attention_math``
(aten/src/ATen/native/transformers/attention.cpp), the math path of SDPA with a mask::

    auto attn = at::matmul(query, key_acc.transpose(-2, -1) * scaling_factor);
    if (attn_mask.has_value()) {
      if (at::areAnyTensorSubclassLike({attn, *attn_mask})) {
        attn = attn.add(*attn_mask);
      } else {
        attn.add_(*attn_mask);
      }
    }
    attn = at::_safe_softmax(attn, -1);

The ``add``'s operand (the matmul's output) dies at once as the twin rule asks, but so does
the operand of ``matmul(q, k) + bias`` in a model's own Python code, which a plain run does
allocate: ``_safe_softmax``, which only this composite calls, tells them apart. Grad mode is
on (a forward), so :func:`plain_writes_in_place` does not apply."""


def confirming_operator(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """The operator that must follow this call, on its output, for a plain run to have written
    the output into ``args[0]`` (:data:`CONFIRMED_TWINS`); None when the call cannot be one
    (another operator, a scaled ``add``, or an output the in-place ``add_`` would not write
    into ``args[0]``: another shape or dtype, a view, a layout it does not keep)."""
    confirm = CONFIRMED_TWINS.get(func)
    if confirm is None or len(args) != 2 or kwargs.get("alpha", 1) != 1:
        return None
    return confirm if dense_like(args[0], out) else None


CHAINS: dict[str, tuple[Any, frozenset[Any]]] = {
    # binary_cross_entropy_with_logits_backward with pos_weight (FunctionsManual.cpp):
    #   plain: t.add(1).sub_(target).mul_(input.sigmoid()).sub_(t); grad_input.mul_(grad);
    #          grad_input.mul_(weight)
    #   subclass / mode: t.add(1).sub(target).mul(input.sigmoid()).sub(t); .mul(grad); ...
    "BinaryCrossEntropyWithLogitsBackward0": (
        aten.add.Scalar,
        frozenset({aten.sub.Tensor, aten.mul.Tensor}),
    ),
}
"""Backward nodes whose plain formula writes a chain of operators into one fresh buffer:
node name -> (the operator that makes the buffer, the out-of-place operators that write into
it in a plain run when their first operand is that buffer)."""
