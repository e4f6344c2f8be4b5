"""Inductor's generated wrapper module, run with its kernels left uncompiled
(``compiled.py`` says how a compiled region is modelled).

Inductor writes a Python wrapper for each graph it compiles and loads it with
``PyCodeCache.load_by_key_path``; while a region compiles here that loader is replaced
(:func:`codegen_only`): the wrapper's source is executed with every kernel a no-op (no C++
compiler runs) and its ``empty_strided_*`` / ``reinterpret_tensor`` helpers made dispatching
``torch`` calls, and its ``call`` runs under the trace's dispatch modes, so the tracker sees the
buffers the generated code allocates and frees. :class:`Active` is the state the stub and the
regions share while a region compiles or runs.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch._guards import detect_fake_mode
from torch.utils._python_dispatch import _pop_mode, _push_mode

STUB_FILE = "<vramledger: Inductor wrapper, kernels not compiled>"
"""The ``__file__`` of a stubbed wrapper module (tracebacks and frames name it)."""


class _StubCompile:
    """Stands in for ``AsyncCompile`` in a wrapper module: every kernel is a no-op."""

    def __getattr__(self, _name: str) -> Callable[..., Callable[..., None]]:
        return lambda *_a, **_k: _no_op_kernel

    def wait(self, _scope: dict[str, Any]) -> None:
        return None


def _fake_active() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _no_op_kernel(*_args: Any, **_kwargs: Any) -> None:
    return None


def _empty_strided(device: str) -> Callable[..., torch.Tensor]:
    def make(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        anchor = Active.anchor
        if anchor is not None and anchor.device.type == device:
            buffer = anchor.new_empty_strided(size, stride, dtype=dtype)
        else:
            buffer = torch.empty_strided(size, stride, dtype=dtype, device=device)
        # The kernels that would fill it are no-ops here: its values are unknown, not the
        # uninitialised memory the value store computed for the empty tensor (a gradient
        # norm read from them decided `clip_grad_norm_`'s non-finite check: litgpt pretrain
        # under bf16-mixed raised there).
        values = getattr(Active.context[-1][0], "values", None) if Active.context else None
        if values is not None:
            values.forget(buffer)
        return buffer

    return make


def _reinterpret(base: torch.Tensor, size: Any, stride: Any, offset: int = 0) -> torch.Tensor:
    """``torch._C._dynamo.guards._reinterpret_tensor``: a view of ``base``'s storage with
    ``offset`` added to its storage offset."""
    return torch.as_strided(base, size, stride, base.storage_offset() + offset)


class Active:
    """The trace's saved dispatch modes while a region runs (a stub's ``call`` puts them back)."""

    modes: ClassVar[list[Any] | None] = None
    context: ClassVar[list[tuple[Any, Any]]] = []
    """(tracker, ``compiled.RegionLog``) of the traces running (innermost last)."""
    anchor: ClassVar[torch.Tensor | None] = None
    """An input of the region running: its buffers are made as ``anchor.new_empty_strided``,
    so the tracker labels them with the anchor's block (``blocks.py``), as it labels an eager
    step's temporaries with their parameter's."""
    calls = 0
    """Calls of stubbed wrapper modules so far (in this process)."""
    region: ClassVar[str | None] = None
    """The region being compiled or running its forward."""
    runs = 0
    """Runs of regions so far (in this process): the wrapper modules that one run loads (a
    forward and its backward) share its number."""
    names: ClassVar[dict[int, str]] = {}
    """Run number of a wrapper module -> the region whose forward ran it last. Dynamo and
    AOTAutograd reuse a compiled graph for another region whose graph is the same (another
    trace's module of the same class), so a wrapper module's region is read when it runs, and
    a backward's is its forward's."""


def _stub_module(
    key: str,
    path: str,
    linemap: Any = None,
    attrs: dict[str, Any] | None = None,
    **_options: Any,
) -> types.ModuleType:
    """Replaces ``PyCodeCache.load_by_key_path`` for the wrapper module Inductor wrote (fresh,
    or from its FX graph cache): executed with uncompiled kernels; its ``call`` runs under the
    trace's modes."""
    from torch._inductor import async_compile

    run = Active.runs
    with open(path) as f:
        source = f.read()
    module = types.ModuleType(f"vramledger_inductor_{key}")
    module.__file__ = STUB_FILE
    real = async_compile.AsyncCompile
    async_compile.AsyncCompile = _StubCompile  # type: ignore[misc, assignment]
    try:
        exec(compile(source, path, "exec"), module.__dict__)
    finally:
        async_compile.AsyncCompile = real  # type: ignore[misc]
    for name, device in (
        ("empty_strided_cpu", "cpu"),
        ("empty_strided_cpu_pinned", "cpu"),
        ("empty_strided_cuda", "cuda"),
    ):
        module.__dict__[name] = _empty_strided(device)
    module.__dict__["reinterpret_tensor"] = _reinterpret
    for name, value in (attrs or {}).items():
        setattr(module, name, value)
    inner = module.call

    def call(args: list[Any]) -> Any:
        Active.calls += 1
        region = Active.region
        if region is not None:  # a forward
            Active.names[run] = region
        else:  # a backward, run by autograd
            region = Active.names.get(run)
        if Active.context and region is not None:
            Active.context[-1][1].graphs.setdefault(region, set()).add(module.__name__)
        previous, Active.anchor = Active.anchor, _anchor(args)
        try:
            return _call(args)
        finally:
            Active.anchor = previous

    def _call(args: list[Any]) -> Any:
        modes = Active.modes
        if modes is None:  # a compiled backward, run by autograd under the trace's own modes
            adopt = getattr(Active.context[-1][0], "adopt", None) if Active.context else None
            if adopt is not None:  # real tangents autograd materialized (a program's trace)
                adopt(args)
            fake = detect_fake_mode(args)
            with fake if fake is not None and not _fake_active() else contextlib.nullcontext():
                return inner(args)
        for mode in reversed(modes):
            _push_mode(mode)
        try:
            return inner(args)
        finally:
            for _ in modes:
                _pop_mode()

    module.call = call
    return module


def _anchor(args: list[Any]) -> torch.Tensor | None:
    """The region's first input that belongs to a block of the trace, else its first tensor."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if Active.context:
        tracker = Active.context[-1][0]
        for t in tensors:
            if tracker.block_of(t) is not None:
                return t
    return tensors[0] if tensors else None


@contextlib.contextmanager
def codegen_only() -> Iterator[None]:
    """Inductor as always, but the wrapper module it writes (or finds in its FX graph cache,
    which then skips the lowering) is loaded by :func:`_stub_module`, so no kernel is compiled;
    the backward graph of a trained region is compiled with its forward."""
    from torch._functorch import config as functorch_config
    from torch._inductor.codecache import PyCodeCache

    original = PyCodeCache.__dict__["load_by_key_path"]
    PyCodeCache.load_by_key_path = staticmethod(_stub_module)  # type: ignore[method-assign, assignment]
    try:
        # the backward graph compiled with the forward, while the trace's modes are aside
        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            yield
    finally:
        PyCodeCache.load_by_key_path = original  # type: ignore[method-assign]
