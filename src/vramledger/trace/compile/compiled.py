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
always; only the last step differs (``PyCodeCache.load_by_key_path``): the wrapper's
source is executed with its kernels left uncompiled (each a no-op; no C++ compiler runs) and its
``empty_strided_*`` / ``reinterpret_tensor`` helpers made dispatching ``torch`` calls. When the
compiled region then runs, Inductor's own ``call`` runs with the trace's modes back in place: the
tracker sees exactly the buffers the generated code allocates and frees (``del bufN``, reuse
lines) and the outputs it returns, in its order, and the fallback (extern) kernels it calls
(``mm`` into a preallocated ``out=``, ``aten`` fallbacks that allocate). This is Inductor's own
output on fake inputs, not its scheduler's buffer list (the stubbed wrapper:
``inductor_stub.py``).

Which regions: the functions libraries compile by name (``COMPILED_FUNCTIONS``: torchao's step);
a user's ``torch.compile(module)`` (``OptimizedModule``); and a user's compiled function, however
it is reached (``torch.compile(fn)`` held anywhere, ``@torch.compile``, ``nn.Module.compile()``,
which compiles the module's ``_call_impl``: here its forward, with the hooks run eagerly), found
when its wrapper runs (:func:`_user_wrappers`).
A user's region is compiled again with ``fullgraph=True`` and the user's Inductor settings, so a
graph break fails while Dynamo traces, before anything runs.

Limits, said in the trace's notes:
- The backend is Inductor's CPU (C++) one: a CPU-only PyTorch has no Triton, so Inductor cannot
  write CUDA kernels here. For a CUDA target the CPU backend's buffer plan is the one used;
  Triton kernels can fuse differently (a reduction and its pointwise epilogue in one kernel keep
  fewer full-size buffers), so there the figure is the CPU plan's, not a measured CUDA one.
- Compiling a region costs seconds (Dynamo, AOTAutograd, and Inductor's lowering and kernel
  source generation, most of it; no C++ compilation): each distinct argument layout is compiled
  once per process (Dynamo's own cache on the region's code, kept per function here), and the
  trace replays identical calls (``step_memo.py``). Inductor's FX graph cache
  (``TORCHINDUCTOR_CACHE_DIR``, on disk) holds the wrapper source of every graph compiled
  before, here or in a real run: a later process finds it there and skips the lowering.
- A region Inductor cannot compile here runs eagerly, and the notes say so with both figures of
  its first call: the eager temporaries, and its outputs only (``eager_regions.py``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import traceback
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import _disable_current_modes

from vramledger.inputs.notes import Note, Topic
from vramledger.trace.compile.eager_regions import run_eagerly
from vramledger.trace.compile.inductor_stub import Active, codegen_only
from vramledger.trace.core.patched_functions import patched_functions

METHOD = (
    "Inductor's own generated wrapper (CPU C++ backend) run on the fake inputs with its kernels "
    "left uncompiled: the buffers it allocates and its outputs count, fused intermediates do not"
)
CUDA_CAVEAT = Note(
    Topic.KERNELS,
    "Inductor's CUDA (Triton) backend cannot run on this CPU-only PyTorch, so the CPU backend's "
    "buffer plan stands in for the CUDA kernels' (Triton may fuse a reduction with its epilogue "
    "and keep fewer full-size buffers: not measured on a GPU)",
)
EAGER = Note(
    Topic.KERNELS,
    "eager: no torch.compile region was called in the traced steps (no compiled module, "
    "function or library region), so every operator is counted as eager PyTorch runs it",
)
"""Said where a trace called no compiled region: the answer's other half of "compiled or
eager", from what the trace ran."""


class RegionNotModelled(Exception):
    """Inductor could not compile the region here (the reason is the message)."""


@dataclass(kw_only=True)
class RegionLog:
    """What the compiled regions of one trace did."""

    graphs: dict[str, set[str]] = field(default_factory=dict)
    """Region name -> the Inductor graphs (wrapper modules) its calls ran: one per argument
    layout, a forward and a backward for a module that is trained."""
    calls: dict[str, int] = field(default_factory=dict)
    """Region name -> calls that ran Inductor's code (replays by ``step_memo`` not counted)."""
    eager: dict[str, str] = field(default_factory=dict)
    """Region name -> why it ran eagerly, with its eager and outputs-only figures."""
    fresh: bool = False
    """Dynamo's compiled code was cleared for this trace (:func:`fresh_dynamo`)."""

    def notes(self, target: str) -> list[str]:
        out = []
        if self.graphs:
            names = ", ".join(
                f"{n} ({len(g)} graph{'s' * (len(g) != 1)})" for n, g in self.graphs.items()
            )
            out.append(
                Note(
                    Topic.KERNELS,
                    f"compiled regions modelled as Inductor runs them: {names}; {METHOD}",
                )
            )
            if target == "cuda":
                out.append(CUDA_CAVEAT)
        for name, why in self.eager.items():
            out.append(
                Note(
                    Topic.KERNELS,
                    f"compiled region {name} could not be modelled, traced eagerly: {why}",
                )
            )
        return out or [EAGER]


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
        self._modules: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = (
            weakref.WeakKeyDictionary()
        )
        """Each trace builds its own modules: kept while they live."""
        self._functions: weakref.WeakKeyDictionary[Any, list[tuple[Any, Callable[..., Any]]]] = (
            weakref.WeakKeyDictionary()
        )
        """A user's compiled functions: (Inductor settings, the function compiled again with
        them) for each, kept while it lives. A function compiled anew at each call (a new
        wrapper each time) is compiled here once per settings."""

    def compiled(self, fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
        """``torch.compile(fn, **options)``, made once per function (on a copy of it)."""
        found = self._compiled.get(fn)
        if found is None:
            found = self._compiled[fn] = torch.compile(_copy(fn), **options)
        return found

    def compiled_module(self, module: Any) -> Callable[..., Any]:
        """A user's ``torch.compile(module, ...)`` compiled again with ``fullgraph=True``, with
        the user's own Inductor settings (mode, options, dynamic): a graph break then fails
        while Dynamo traces, before anything runs (code between graphs would run untracked).
        Another backend than Inductor is not modelled."""
        found = self._modules.get(module)
        if found is None:
            options = _inductor_options(module.dynamo_ctx)
            found = torch.compile(module._orig_mod, **options).forward
            self._modules[module] = found
        return found

    def compiled_wrapper(self, context: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A user's ``torch.compile(fn)`` (``context``: the ``_TorchDynamoContext`` of the
        wrapper it returned) compiled again, on a copy of ``fn``, with ``fullgraph=True`` and
        the user's own Inductor settings, as :meth:`compiled_module` does; once per function
        and settings (``fn`` a plain function: a method is compiled unbound, its object the
        first argument)."""
        options = _inductor_options(context)
        made = self._functions.setdefault(fn, [])
        for backend, compiled in made:
            if backend == options["backend"]:  # the same Inductor settings
                return compiled
        compiled = torch.compile(_copy(fn), **options)
        made.append((options["backend"], compiled))
        return compiled

    def run(
        self,
        name: str,
        compiled: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        log: RegionLog,
    ) -> Any:
        """Call ``compiled`` (a ``torch.compile(fullgraph=True)`` result for Inductor) with the
        trace's modes set aside while Dynamo and Inductor compile, and back in place while
        Inductor's code runs. Raise :class:`RegionNotModelled` if it cannot be compiled here
        (nothing has run then); the caller then runs the region eagerly."""
        import torch._dynamo
        from torch._dynamo.utils import counters

        if not log.fresh:
            fresh_dynamo()
            log.fresh = True
        before = (Active.calls, sum(counters["graph_break"].values()))
        with _disable_current_modes() as modes, codegen_only():
            Active.modes, Active.region = list(modes), name
            Active.runs += 1
            try:
                with (
                    torch.compiler.set_stance("default"),
                    torch._dynamo.utils.disable_cache_limit(),
                    torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
                ):
                    out = compiled(*args, **kwargs)
            except STOPS_RECOMPUTATION:
                raise  # the region ran: checkpointing's early stop, not a refusal
            except Exception as exc:  # Dynamo, AOTAutograd or Inductor refused the region
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                _release_frames(exc)
                raise RegionNotModelled(f"{type(exc).__name__}: {text}") from exc
            finally:
                Active.modes = Active.region = None
        if sum(counters["graph_break"].values()) != before[1] or Active.calls == before[0]:
            # fullgraph=True makes a graph break an error while Dynamo traces: never here
            raise AssertionError(f"{name}: torch.compile did not run one Inductor graph")
        log.calls[name] = log.calls.get(name, 0) + 1
        return out


def _inductor_options(context: Any) -> dict[str, Any]:
    """``torch.compile`` options that compile again what ``context`` (a
    ``_TorchDynamoContext``) compiles, with its own Inductor settings (mode, options,
    ``dynamic``) and ``fullgraph=True``; :class:`RegionNotModelled` for another backend."""
    from torch._dynamo.eval_frame import innermost_backend

    backend = innermost_backend(context.callback)
    if not isinstance(backend, torch._TorchCompileInductorWrapper):
        name = getattr(backend, "compiler_name", None) or repr(backend)
        raise RegionNotModelled(f"its backend {name!r} is not Inductor")
    return {"fullgraph": True, "dynamic": backend.dynamic, "backend": backend}


def _release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames in ``exc``'s tracebacks (and its causes'). A
    failed compile keeps the region's arguments in reference cycles through them (Dynamo's
    tracing frames), which only the cyclic collector would free: the eager run that follows
    would hold them longer than a plain run does."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


STOPS_RECOMPUTATION = torch.utils.checkpoint._StopRecomputationError
"""Raised by non-reentrant activation checkpointing's pack hook inside a region it recomputes,
once every tensor the forward saved is back (``early_stop``, the default): the region ran, and
checkpointing catches it. Taken for a compile failure, the region ran again eagerly and saved
more tensors than the forward had ("target_frame.early_stop is set": torchtune's compile with
activation checkpointing, each compiled layer inside its checkpoint wrapper)."""

REGIONS = CompiledRegions()
"""The process's compiled regions (Dynamo's cache is per process too)."""


TORCHAO_COMPILE = {"fullgraph": True, "dynamic": False}
"""How torchao compiles its step: ``torch.compile(single_param_adam, fullgraph=True,
dynamic=False)`` in ``_AdamBase.step`` (``torchao/optim/adam.py``)."""
COMPILED_FUNCTIONS = (("torchao.optim.adam", "single_param_adam", TORCHAO_COMPILE),)
"""Module-level functions that libraries ``torch.compile`` at each call, by name (so a patched
module attribute is what they compile), with the options they compile them with. Under the
trace's ``force_eager`` stance their ``torch.compile`` runs the patched function eagerly, and
that function runs the region as Inductor does."""


@contextlib.contextmanager
def compiled_regions(tracker: Any, notes: list[str], target: str) -> Iterator[None]:
    """Within this context, the functions of ``COMPILED_FUNCTIONS``, every ``torch.compile``'d
    module (``OptimizedModule``) and every function a user compiled (``torch.compile(fn)``,
    ``@torch.compile``, ``nn.Module.compile()``) run as Inductor runs them. What they did is
    added to ``notes`` at the end (``target``: the trace's device type)."""
    from torch._dynamo.eval_frame import OptimizedModule

    log = RegionLog()
    options = {(m, n): o for m, n, o in COMPILED_FUNCTIONS}

    def region(module_name: str, name: str, original: Any) -> Any:
        return _function_region(f"{module_name}.{name}", original, options[module_name, name])

    module_call = OptimizedModule.__call__
    OptimizedModule.__call__ = _module_region()  # type: ignore[method-assign]
    Active.context.append((tracker, log))
    try:
        with patched_functions(options, region), _user_wrappers(), fresh_shape_profile():
            yield
    finally:
        Active.context.pop()
        OptimizedModule.__call__ = module_call  # type: ignore[method-assign]
        notes.extend(n for n in log.notes(target) if n not in notes)


def _function_region(region: str, fn: Callable[..., Any], options: dict[str, Any]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        tracker, log = Active.context[-1]
        start = tracker.position()
        try:
            return REGIONS.run(region, REGIONS.compiled(fn, options), args, kwargs, log=log)
        except RegionNotModelled as exc:
            return run_eagerly(region, str(exc), fn, args, kwargs, start)

    return call


def fresh_dynamo() -> None:
    """Dynamo as a fresh process has it, before a trace's first compiled region: every frame's
    compiled code and guards cleared, and its automatic-dynamic record of the sizes each
    function was compiled at (``torch._dynamo.reset()``; Inductor's on-disk caches are kept). A
    program run in a fresh interpreter compiles its regions with nothing compiled before; in
    this process Dynamo keeps what every earlier trace and the caller compiled, per code object
    (transformers' ``deprecate_kwarg`` wrapper is one code object for every model's forward),
    and the same region then compiled otherwise: measured at 9f97c06 (without this), the
    compiled tiny Llama's 2x32 estimate gave 2,220,380 B alone (its plain run's count) and
    2,362,440 B after ten other tiny Llamas were compiled in the process; a run of the slow
    tests (7cedbfa) and a CI run (163f827) saw 2,509,152 B. Called only by a trace that reaches
    a compiled region: a caller's compiled code survives traces that compile nothing."""
    torch._dynamo.reset()


@contextlib.contextmanager
def fresh_shape_profile() -> Iterator[None]:
    """The caller's automatic-dynamic record back after the trace: :func:`fresh_dynamo` clears
    it for the trace's regions, and the sizes they compile at are the trace's, not the
    caller's. Dynamo keeps, per function (by file, line and name, so across ``_copy``'s code
    objects and ``torch.compile`` wrappers), the input sizes it compiled; a function compiled
    again at other sizes is compiled with those dimensions symbolic."""
    from torch._dynamo import pgo

    kept = pgo._CODE_STATE, pgo._INIT_CODE_STATE, pgo._LOGGED_DYNAMIC_ALLOWLIST
    try:
        yield
    finally:
        pgo._CODE_STATE, pgo._INIT_CODE_STATE, pgo._LOGGED_DYNAMIC_ALLOWLIST = kept


@contextlib.contextmanager
def _user_wrappers() -> Iterator[None]:
    """Runs the functions a user compiled as Inductor runs them.

    ``torch.compile(fn)`` returns a wrapper (``compile_wrapper`` in
    ``torch/_dynamo/eval_frame.py``) that, under the trace's ``force_eager`` stance, asks
    ``_callback_from_stance`` for its Dynamo callback (none: run eagerly) and then calls ``fn``,
    which it reads from its closure. While this context is active, that lookup finds the wrapper
    that asks (the function whose code the asking frame runs and whose context is the frame's
    ``self``: ``gc.get_referrers`` of the code, once per wrapper and trace) and puts a region
    function in its ``fn`` cell, so that this call and the later ones run the region. Every
    reference to the wrapper is covered (a module attribute, ``@torch.compile`` on a function,
    ``nn.Module.compile()``'s ``_compiled_call_impl``); the cells are restored on exit. Dynamo
    itself inlines a wrapper through its ``_torchdynamo_inline`` attribute, which is left
    alone."""
    from torch._dynamo import eval_frame

    original = eval_frame._callback_from_stance
    swapped: list[tuple[Any, Any]] = []
    """(cell, the function it held) of each wrapper redirected."""
    regions: set[int] = set()
    """The region functions put in those cells (a wrapper redirected already calls one)."""

    def from_stance(callback: Any) -> Any:
        found = original(callback)
        if (
            found is None
            and callback not in (None, False)
            and eval_frame._stance.stance == "force_eager"
            and Active.context
            and Active.modes is None
        ):
            frame = sys._getframe(1)
            code = frame.f_code
            if code.co_name == "compile_wrapper" and code.co_filename == eval_frame.__file__:
                cell = None if id(frame.f_locals["fn"]) in regions else _fn_cell(frame)
                if cell is not None:
                    swapped.append((cell, cell.cell_contents))
                    cell.cell_contents = _wrapper_region(frame.f_locals["self"], swapped[-1][1])
                    regions.add(id(cell.cell_contents))
        return found

    eval_frame._callback_from_stance = from_stance
    try:
        yield
    finally:
        eval_frame._callback_from_stance = original
        for cell, fn in reversed(swapped):
            cell.cell_contents = fn


def _fn_cell(frame: types.FrameType) -> Any:
    """The ``fn`` cell of the ``compile_wrapper`` function that ``frame`` runs, or ``None``
    where ``fn`` is a function of ``COMPILED_FUNCTIONS`` as the trace patched it (torchao's
    step, which already runs its region)."""
    context, fn = frame.f_locals["self"], frame.f_locals["fn"]
    for module_name, name, _ in COMPILED_FUNCTIONS:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, name, None) is fn:
            return None
    code = frame.f_code
    for wrapper in gc.get_referrers(code):
        if not isinstance(wrapper, types.FunctionType) or wrapper.__code__ is not code:
            continue
        cells = dict(zip(code.co_freevars, wrapper.__closure__ or (), strict=True))
        if cells["self"].cell_contents is context:
            return cells["fn"]
    raise AssertionError(f"no torch.compile wrapper found for {fn!r}")  # pragma: no cover


def _wrapper_region(context: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """What a user's ``torch.compile`` wrapper calls in a trace instead of ``fn``: ``fn`` as
    Inductor runs it (:meth:`CompiledRegions.compiled_wrapper`), else eagerly with the note."""
    bound = getattr(fn, "__self__", None)
    if isinstance(bound, torch.nn.Module) and fn.__name__ == "_call_impl":
        return _compiled_call_impl(context, bound, fn)
    name = f"{getattr(fn, '__qualname__', repr(fn))} (torch.compile'd function)"
    if isinstance(fn, types.MethodType):  # torch.compile(model.forward): compiled unbound
        return functools.partial(_run_region, name, context, fn.__func__, (fn.__self__,))
    return functools.partial(_run_region, name, context, fn, ())


def _compiled_call_impl(
    context: Any, module: torch.nn.Module, call_impl: Callable[..., Any]
) -> Callable[..., Any]:
    """``nn.Module.compile()`` compiles the module's ``_call_impl``: here ``_call_impl`` runs
    eagerly, so the module's hooks run as ``nn.Module.__call__`` runs them (the tracker's block
    labels, an engine's hooks; traced by Dynamo they would be part of the graph), with its
    ``forward`` replaced for the call by the forward as Inductor runs it, as for a
    ``torch.compile``'d module. Its forward is compiled unbound, the module its first
    argument."""
    name = f"{type(module).__name__} (nn.Module.compile'd module)"
    forward = type(module).forward
    region = functools.partial(_run_region, name, context, forward, (module,))

    def call(*args: Any, **kwargs: Any) -> Any:
        saved = module.__dict__.get("forward")
        module.__dict__["forward"] = region
        try:
            return call_impl(*args, **kwargs)
        finally:
            if saved is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = saved

    return call


def _run_region(
    name: str,
    context: Any,
    fn: Callable[..., Any],
    leading: tuple[Any, ...],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``fn(*leading, *args, **kwargs)`` compiled again as ``context`` compiles it and run as
    Inductor runs it; eagerly, with the note, where that cannot be done."""
    tracker, log = Active.context[-1]
    start = tracker.position()
    try:
        with _trace_hooks_aside(next((a for a in leading if isinstance(a, torch.nn.Module)), None)):
            compiled = REGIONS.compiled_wrapper(context, fn)
            return REGIONS.run(name, compiled, (*leading, *args), kwargs, log=log)
    except RegionNotModelled as exc:
        reason = str(exc)
    return run_eagerly(name, reason, fn, (*leading, *args), kwargs, start)


@contextlib.contextmanager
def _trace_hooks_aside(module: torch.nn.Module | None = None) -> Iterator[None]:
    """The trace's module hooks set aside while a region is traced by Dynamo and runs, as
    Dynamo would otherwise trace them into its graph (and refuse the graph: their side effects
    on the tracker are not nullified): the global hooks (the tracker's module attribution), and
    the tracker's own hooks on ``module`` and its submodules (its block labels, when the region
    is a whole model). The region's storages belong to the module that calls it, and inside a
    compiled model they carry no block label (the block extension then traces in full)."""
    from torch.nn.modules import module as nn_module

    tracker = Active.context[-1][0]
    hooks = [nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks]
    owned = [lambda _h: True, lambda _h: True]
    for m in module.modules() if module is not None else ():
        hooks += [m._forward_pre_hooks, m._forward_hooks]
        owned += [lambda h: getattr(h, "__self__", None) is tracker] * 2
    saved = [list(h.items()) for h in hooks]
    for h, ours in zip(hooks, owned, strict=True):
        for key in [k for k, hook in h.items() if ours(hook)]:
            del h[key]
    try:
        yield
    finally:
        for h, items in zip(hooks, saved, strict=True):
            h.clear()
            h.update(items)


def _module_region() -> Any:
    """``OptimizedModule.__call__`` in a trace: ``nn.Module.__call__`` on the wrapper as
    always (its own hooks run: the tracker's block labels, when the wrapper is a block), with
    its forward, ``dynamo_ctx(_orig_mod.__call__)``, replaced for the call by the module's
    forward graph as Inductor runs it, and its backward graph (compiled with it) when autograd
    reaches it."""

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = self.__dict__["forward"]
        self.__dict__["forward"] = functools.partial(_module_forward, self)
        try:
            return torch.nn.Module.__call__(self, *args, **kwargs)
        finally:
            self.__dict__["forward"] = saved

    return call


def _module_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
    tracker, log = Active.context[-1]
    name = f"{type(module._orig_mod).__name__} (torch.compile'd module)"
    start = tracker.position()
    try:
        with _trace_hooks_aside(module._orig_mod):
            compiled = REGIONS.compiled_module(module)
            return REGIONS.run(name, compiled, args, kwargs, log=log)
    except RegionNotModelled as exc:
        reason = str(exc)
    return run_eagerly(name, reason, module._orig_mod, args, kwargs, start)
