"""Compiled regions (``torch.compile``) in a fake-tensor trace, as Inductor runs them.

Eagerly, a region allocates every intermediate of its Python code; compiled by Inductor it
allocates only its outputs and the buffers its generated code asks for (``empty_strided_*``
calls in the wrapper Inductor writes); intermediates fused into a kernel never exist. torchao's
low-bit Adam steps (``torch.compile(single_param_adam, fullgraph=True, dynamic=False)`` in
``torchao/optim/adam.py``) are the case that matters: eagerly, the 8-bit step of one parameter
makes a dozen fp32 copies of it, compiled on CPU two.

How a region is modelled here: its function is compiled for real by Dynamo, AOTAutograd and
Inductor, on the trace's fake tensors, with every dispatch mode of the trace set aside while it
compiles. Inductor lowers, schedules and fuses the graph and writes its wrapper module as
always; only the last step differs (``GraphLowering._compile_to_module_lines``): the wrapper's
source is executed with its kernels left uncompiled (each a no-op; no C++ compiler runs) and its
``empty_strided_*`` / ``reinterpret_tensor`` helpers made dispatching ``torch`` calls. When the
compiled region then runs, Inductor's own ``call`` runs with the trace's modes back in place: the
tracker sees exactly the buffers the generated code allocates and frees (``del bufN``, reuse
lines) and the outputs it returns, in its order, and the fallback (extern) kernels it calls
(``mm`` into a preallocated ``out=``, ``aten`` fallbacks that allocate). This is Inductor's own
output on fake inputs, not its scheduler's buffer list.

Limits, said in the trace's notes:
- The backend is Inductor's CPU (C++) one: a CPU-only PyTorch has no Triton, so Inductor cannot
  write CUDA kernels here. For a CUDA target the CPU backend's buffer plan is the one used;
  Triton kernels can fuse differently (a reduction and its pointwise epilogue in one kernel keep
  fewer full-size buffers), so there the figure is the CPU plan's, not a measured CUDA one.
- Compiling a region costs seconds (Dynamo, AOTAutograd, Inductor's lowering; no C++
  compilation): each distinct argument layout is compiled once per process (Dynamo's own cache
  on the region's code, kept per function here) and the trace replays identical calls
  (``step_memo.py``).
- A region Inductor cannot compile here runs eagerly, and the notes say so with both figures of
  its first call: the eager temporaries, and its outputs only (:func:`call_figures`).
"""

from __future__ import annotations

import contextlib
import hashlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes, _pop_mode, _push_mode

from ..timeline import Timeline

METHOD = (
    "Inductor's own generated wrapper (CPU C++ backend) run on the fake inputs with its kernels "
    "left uncompiled: the buffers it allocates and its outputs count, fused intermediates do not"
)
CUDA_CAVEAT = (
    "Inductor's CUDA (Triton) backend cannot run on this CPU-only PyTorch, so the CPU backend's "
    "buffer plan stands in for the CUDA kernels' (Triton may fuse a reduction with its epilogue "
    "and keep fewer full-size buffers: not measured on a GPU)"
)
STUB_FILE = "<vramledger: Inductor wrapper, kernels not compiled>"


class RegionNotModelled(Exception):
    """Inductor could not compile the region here (the reason is the message)."""


@dataclass(kw_only=True)
class RegionLog:
    """What the compiled regions of one trace did."""

    compiled: dict[str, int] = field(default_factory=dict)
    """Region name -> graphs Inductor compiled for it (one per argument layout)."""
    calls: dict[str, int] = field(default_factory=dict)
    """Region name -> calls that ran Inductor's code (replays by ``step_memo`` not counted)."""
    eager: dict[str, str] = field(default_factory=dict)
    """Region name -> why it ran eagerly, with its eager and outputs-only figures."""

    def notes(self, target: str) -> list[str]:
        out = []
        if self.compiled:
            names = ", ".join(f"{n} ({g} graph{'s' * (g != 1)})" for n, g in self.compiled.items())
            out.append(f"compiled regions modelled as Inductor runs them: {names}; {METHOD}")
            if target == "cuda":
                out.append(CUDA_CAVEAT)
        for name, why in self.eager.items():
            out.append(f"compiled region {name} could not be modelled, traced eagerly: {why}")
        return out


class _StubCompile:
    """Stands in for ``AsyncCompile`` in a wrapper module: every kernel is a no-op."""

    def __getattr__(self, _name: str) -> Callable[..., Callable[..., None]]:
        return lambda *_a, **_k: _no_op_kernel

    def wait(self, _scope: dict[str, Any]) -> None:
        return None


def _no_op_kernel(*_args: Any, **_kwargs: Any) -> None:
    return None


def _empty_strided(device: str) -> Callable[..., torch.Tensor]:
    def make(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return make


def _reinterpret(base: torch.Tensor, size: Any, stride: Any, offset: int = 0) -> torch.Tensor:
    """``torch._C._dynamo.guards._reinterpret_tensor``: a view of ``base``'s storage with
    ``offset`` added to its storage offset."""
    return torch.as_strided(base, size, stride, base.storage_offset() + offset)


class _Active:
    """The trace's saved dispatch modes while a region runs (a stub's ``call`` puts them back)."""

    modes: list[Any] | None = None
    calls = 0


def _stub_module(graph: Any, wrapper_code: Any) -> types.ModuleType:
    """Replaces ``GraphLowering._compile_to_module_lines``: the wrapper module Inductor wrote,
    executed with uncompiled kernels; its ``call`` runs under the trace's modes."""
    from torch._inductor import async_compile
    from torch._inductor.codecache import PyCodeCache

    source = wrapper_code.value
    key, path = PyCodeCache.write(source)
    graph.cache_key = key
    graph.cache_path = path
    graph.cache_linemap = []
    module = types.ModuleType(f"vramledger_inductor_{hashlib.sha1(source.encode()).hexdigest()}")
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
    inner = module.call

    def call(args: list[Any]) -> Any:
        _Active.calls += 1
        modes = _Active.modes
        if modes is None:  # compiled outside a trace: nothing to record
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


@contextlib.contextmanager
def _codegen_only() -> Iterator[None]:
    """Inductor as always, but its wrapper module is built by :func:`_stub_module`; its caches
    (which would skip the lowering or load compiled kernels) are off."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    original = GraphLowering._compile_to_module_lines
    GraphLowering._compile_to_module_lines = _stub_module  # type: ignore[method-assign]
    try:
        with (
            inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            yield
    finally:
        GraphLowering._compile_to_module_lines = original  # type: ignore[method-assign]


def _copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its own code object: Dynamo keeps its compiled graphs on the code, so the
    stubs stay apart from the library's real compiled code in the same process."""
    code = fn.__code__.replace()
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


class CompiledRegions:
    """Runs ``torch.compile`` regions of a trace as Inductor runs them (see the module's
    docstring). One per process: Dynamo's compiled graphs (per function and argument layout)
    are kept and reused by every trace."""

    def __init__(self) -> None:
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
        self._graphs: dict[Callable[..., Any], set[Any]] = {}

    def run(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        signature: Any,
        log: RegionLog,
        options: dict[str, Any],
    ) -> Any:
        """Call ``fn`` compiled with ``torch.compile(**options)``; raise
        :class:`RegionNotModelled` if it cannot be (nothing has run then)."""
        import torch._dynamo

        compiled = self._compiled.get(fn)
        if compiled is None:
            compiled = torch.compile(_copy(fn), **options)
            self._compiled[fn] = compiled
        seen = self._graphs.setdefault(fn, set())
        before = _Active.calls
        with _disable_current_modes() as modes, _codegen_only():
            _Active.modes = list(modes)
            try:
                with (
                    torch.compiler.set_stance("default"),
                    torch._dynamo.utils.disable_cache_limit(),
                    torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
                ):
                    out = compiled(*args, **kwargs)
            except Exception as exc:  # Dynamo, AOTAutograd or Inductor refused the region
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise RegionNotModelled(f"{type(exc).__name__}: {text}") from exc
            finally:
                _Active.modes = None
        if _Active.calls == before:
            raise AssertionError(f"{name}: torch.compile ran without Inductor's code")
        if signature not in seen:
            seen.add(signature)
            log.compiled[name] = log.compiled.get(name, 0) + 1
        log.calls[name] = log.calls.get(name, 0) + 1
        return out


REGIONS = CompiledRegions()
"""The process's compiled regions (Dynamo's cache is per process too)."""


def call_figures(timeline: Timeline, start: tuple[int, int, int]) -> tuple[int, int]:
    """Of the events since ``start`` (``StorageTracker.position``): the most bytes that storages
    made among them held at once (the eager temporaries' peak, outputs included), and the bytes
    of those still alive at the end (the outputs only)."""
    first_event, first_sid, _ = start
    live = peak = 0
    alive: set[int] = set()
    for e in timeline.events[first_event:]:
        sid = e if e >= 0 else ~e
        if sid < first_sid:
            continue
        if e >= 0:
            alive.add(sid)
            live += timeline.nbytes[sid]
            peak = max(peak, live)
        elif sid in alive:
            alive.discard(sid)
            live -= timeline.nbytes[sid]
    return peak, live
