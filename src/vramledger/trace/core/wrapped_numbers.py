"""Python numbers that autograd keeps as tensors: a storage no dispatch-level tracker sees made.

``x * 0.5`` calls ``aten::mul.Tensor`` with a Python number where the schema wants a Tensor.
PyTorch's argument parser wraps it in a 0-dim CPU tensor (``PythonArgs::tensor_slow`` in
torch/csrc/utils/python_arg_parser.cpp: ``scalar_to_tensor(scalar)`` then
``set_wrapped_number(true)``; ``scalar_to_tensor``'s CPU fast path,
``at::detail::scalar_tensor_static`` in aten/src/ATen/ScalarOps.h, dispatches no operator:
float64 for a float, int64 for an int, bool, complex128), and a ``TorchDispatchMode`` is
handed the Python number back (on torch 2.13 ``aten.mul.Tensor`` arrives as ``(x, 0.5)``).
While the call runs the CPU
scratch probe counts it (the probe's own call wraps the number the same way), but when the
backward formula needs it autograd saves it (``MulBackward0``/``DivBackward0`` save ``other``
when ``self`` needs a gradient: tools/autograd/derivatives.yaml) and the 8 bytes live until
that node runs in backward. The tracker registers those saved tensors, read from the node
once autograd has attached it to the output (after the call: the node does not exist inside
``__torch_dispatch__``), so their free is seen when the node releases them.

Measured on torch 2.13: wav2vec2-bert's ``0.5 * feed_forward(x)`` half-step residuals
(6 calls alive at the backward peak, 48 bytes), Granite Speech's and wav2vec2-conformer's
likewise (docs/plain-run-paths.md, "Zoo audio cases").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

WRAPPED_DTYPES = frozenset({torch.float64, torch.int64, torch.bool, torch.complex128})
"""The dtypes ``scalar_to_tensor`` gives a wrapped Python float, int, bool, complex."""


def _wrapped_dtype(value: Any) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.complex128 if isinstance(value, complex) else torch.float64


def wrapped_numbers(func: Any, args: tuple[Any, ...]) -> list[tuple[str, torch.dtype]]:
    """(name, dtype) of each positional Tensor argument of ``func`` given as a Python number."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    return [
        (arg.name, _wrapped_dtype(value))
        for arg, value in zip(schema.arguments, args, strict=False)
        if isinstance(value, (bool, int, float, complex))
        and isinstance(arg.type, torch._C.TensorType)
    ]


def held_wrapped_bytes(func: Any, args: tuple[Any, ...]) -> int:
    """Bytes of the wrapped numbers of a call that a scratch probe counts but a plain run
    already holds. The probe calls ``func`` with the Python number, so the argument parser
    wraps it inside the probe's count. In a forward that is the plain run's own wrapping
    (made just before the call, alive while it runs); in backward a Tensor argument given as
    a Python number is a wrapped tensor that exists before the call, a saved one (``other``
    of ``MulBackward0``/``DivBackward0``, registered by the tracker), not the kernel's."""
    if torch._C._current_autograd_node() is None:
        return 0
    return sum(dtype.itemsize for _, dtype in wrapped_numbers(func, args))


def saved_wrapped_numbers(
    out: torch.Tensor, names: list[str], known: Callable[[int], bool]
) -> list[torch.Tensor]:
    """The wrapped numbers ``out``'s autograd node saved, read by their argument names
    (autograd's generated nodes expose a saved argument ``x`` as ``_saved_x``): those on
    ``out``'s device (a CUDA step's wrapped numbers are host memory) whose storage the tracker
    never saw (``known(key)`` false). Reading one runs no saved-tensor hook: ``SavedVariable``
    saves a wrapped number as it is, never through the hooks (torch/csrc/autograd/
    saved_variable.cpp: ``if (maybe_hooks && !variable.unsafeGetTensorImpl()
    ->is_wrapped_number())``), so activation checkpointing keeps them too."""
    if out._is_view():
        # an in-place call on a view (``q /= math.sqrt(d)`` on a Linear's output): its
        # wrapped number sits in the base's ``CopySlices``, which exposes no saved tensors, and
        # reading the view's ``grad_fn`` regenerates it, replaying its view functions through
        # this very mode while autograd holds the view's lock: the tracker's next dispatch would
        # read it again and deadlock (Longformer's global attention). Its 8 bytes are missed.
        return []
    node = out.grad_fn
    if node is None:
        return []
    found = []
    for name in names:
        try:
            saved = getattr(node, f"_saved_{name}", None)
        except RuntimeError:  # not saved by this node (freed or never packed)
            continue
        if (
            isinstance(saved, torch.Tensor)
            and saved.dim() == 0
            and saved.dtype in WRAPPED_DTYPES
            and saved.device == out.device
            and not known(saved.untyped_storage()._cdata)
        ):
            found.append(saved)
    return found
