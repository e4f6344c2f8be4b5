"""The user's own program, run unchanged in this process: a ``.py`` script, ``-m MODULE`` or a
console script, with ``sys.argv`` set as the shell would set it.

This module knows nothing of memory. It runs the program (``runpy``), counts optimizer steps
(``torch.optim``'s global step hooks, so every optimizer the program makes is seen), stops the
program after ``max_steps`` steps in all or after ``timeout`` seconds (an internal
``BaseException`` that the program's ``except Exception`` does not catch), skips checkpoint
saves, and tells apart how the program ended: it ran to its end, it was stopped, or it raised
(its exception, with its traceback, is the program's, not vramledger's). What runs around it
(fake tensors and CUDA emulation, ``trace/program/program_trace.py``; a real CPU run,
``measure/program.py``) comes in through :class:`StepHooks`. Which stack frames are the
program's own (for its lines, names and tracebacks) is ``program_frames.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import re
import runpy
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from vramledger.inputs.checkpoint_shapes import replace_everywhere
from vramledger.inputs.errors import InputError, VramledgerError
from vramledger.inputs.program_frames import (
    PROGRAM_DIRS,
    program_location,
    program_name_of,
    program_traceback,
)
from vramledger.inputs.saved_objects import SavedObjects

DEFAULT_MAX_STEPS = 20
"""Optimizer steps in all (every optimizer counted) after which the program is stopped."""

Ending = Literal["ended", "max-steps", "timeout"]


@dataclass(frozen=True, kw_only=True)
class ProgramSpec:
    """What to run, and for how long."""

    program: str
    """A ``.py`` file, a module name (with ``module=True``) or a console script's name."""
    args: tuple[str, ...] = ()
    """The program's own arguments (``sys.argv[1:]``)."""
    module: bool = False
    """``program`` is a module to run as ``python -m``."""
    max_steps: int = DEFAULT_MAX_STEPS
    """Stop the program after this many optimizer steps in all."""
    timeout: float | None = None
    """Stop the program after this many seconds (a program that never steps)."""
    nproc_per_node: int = 1
    """Run the program as ``torchrun --nproc-per-node N`` would: N processes per node, each
    with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ...), its process group a fake
    one (a real gloo one with --measure), one ledger per distinct rank."""
    nnodes: int = 1
    """Nodes, as ``torchrun --nnodes M``: the world is M x --nproc-per-node ranks, every one
    traced (or run, with --measure) on this machine."""

    def __post_init__(self) -> None:
        for option, value in (("--nproc-per-node", self.nproc_per_node), ("--nnodes", self.nnodes)):
            if value < 1:
                raise InputError(
                    f"{option} must be at least 1, not {value}",
                    hint=f"{option} 2 runs the program as two ranks",
                )
        if self.max_steps < 1:
            raise InputError(
                f"--max-steps must be at least 1, not {self.max_steps}",
                hint="two steps or more give a steady window",
            )
        if self.timeout is not None and self.timeout <= 0:
            raise InputError(f"--timeout must be positive, not {self.timeout}")

    @property
    def world_size(self) -> int:
        """Ranks in all: ``nnodes x nproc_per_node``."""
        return self.nnodes * self.nproc_per_node


_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)*)?$")
"""An interpreter's file name: ``python``, ``python3``, ``python3.11``."""


HARMLESS_INTERPRETER_OPTIONS = frozenset({"-u", "-B"})
"""Interpreter options that change nothing the program computes (unbuffered output, no
``.pyc`` files written): accepted and skipped (``python -u train.py``, as job scripts write)."""


def is_interpreter(word: str) -> bool:
    """``word`` names a Python interpreter (``python``, ``python3.11``, ``/usr/bin/python3``,
    ``sys.executable``), as a profiler's command line starts: ``-- python train.py``."""
    if word == sys.executable:
        return True
    path = Path(word)
    return bool(_PYTHON_NAME.match(path.name)) and (len(path.parts) == 1 or path.exists())


def parse_command(command: list[str]) -> tuple[str, tuple[str, ...], bool]:
    """``(program, args, module)`` of a command line as a shell would run it: ``train.py ARGS``,
    ``-m MODULE ARGS``, ``CONSOLE_SCRIPT ARGS``, each optionally after the interpreter
    (``python train.py``, ``/usr/bin/python3 -m torchtitan.train``), which runs here in this
    process's interpreter. An interpreter option other than ``-m`` (and
    :data:`HARMLESS_INTERPRETER_OPTIONS`) is refused in one line."""
    words = list(command)
    if words and is_interpreter(words[0]):
        words = words[1:]
        while words and words[0] in HARMLESS_INTERPRETER_OPTIONS:
            words = words[1:]
        if words and words[0].startswith("-") and words[0] != "-m":
            raise InputError(
                f"the interpreter option {words[0]} is not applied by vramledger run",
                hint="give the script (or -m MODULE) right after python, and set PYTHON* "
                "environment variables for interpreter settings",
            )
        if not words:
            raise InputError("no program after the interpreter", hint="write `-- python train.py`")
    module = bool(words) and words[0] == "-m"
    if module:
        words = words[1:]
    if not words:
        raise InputError(
            "no program to run", hint="write `vramledger run [OPTIONS] -- train.py [ARGS...]`"
        )
    return words[0], tuple(words[1:]), module


class StopProgram(BaseException):
    """Raised inside the program to stop it (a BaseException: ``except Exception`` in the
    program does not catch it)."""

    def __init__(self, ending: Ending) -> None:
        super().__init__(ending)
        self.ending: Ending = ending


class ProgramFailed(VramledgerError):
    """The program raised: its own exception, shown with its own traceback."""

    def __init__(self, exc: BaseException, program_traceback: str, steps: int) -> None:
        super().__init__(
            f"the program raised {type(exc).__name__}: {_first_line(exc)} (after {steps} "
            f"optimizer step{'s' if steps != 1 else ''})",
            hint="its traceback is above",
        )
        self.exception = exc
        self.program_traceback = program_traceback
        self.steps = steps
        self.children: list[str] = []
        """Python processes the program had started (``ProgramRun.children``)."""
        self.confirmed = False
        """A run with no trace raised it too (``attribution.py``), or this was that run: the
        error is the program's. Until then it is not said whose it is."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class StepHooks(Protocol):
    """What runs around the program's optimizer steps (the trace's phases, a real run's
    counts)."""

    def before_step(self, optimizer: Any, step: int) -> None: ...

    def after_step(self, optimizer: Any, step: int) -> None: ...

    def stepped_within(self, optimizer: Any) -> None:
        """``optimizer`` stepped inside another's step (which is the program's one step)."""

    def closure(self, optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
        """What runs as ``optimizer.step(closure)``'s closure (the program's forward and
        backward, run by the step)."""

    def before_step_in_backward(self, optimizer: Any, step: int) -> None:
        """``optimizer`` steps inside training step ``step``'s backward (one optimizer per
        parameter, stepped from its gradient hook: torchtune's ``optimizer_in_bwd``)."""

    def after_step_in_backward(self, optimizer: Any, step: int) -> None:
        """That step returned; the backward goes on (``after_step(None, step)`` follows when
        the backward ends)."""


@dataclass(kw_only=True)
class ProgramRun:
    """How a program ran: its steps (1-based, in all) and which optimizer made each."""

    ending: Ending = "ended"
    steps: int = 0
    optimizer_of_step: dict[int, int] = field(default_factory=dict)
    """Step -> index of the optimizer that made it, in order of first step."""
    optimizer_names: list[str] = field(default_factory=list)
    """Each optimizer's name (its class, numbered when two share one)."""
    skipped_saves: list[str] = field(default_factory=list)
    """Where the program asked to save (``torch.save at train.py:80``), skipped."""
    children: list[str] = field(default_factory=list)
    """Python processes the program started (``accelerate launch``, ``trl sft``): their
    commands, which vramledger does not follow (:func:`children_note`)."""
    exit_code: int = 0
    seconds: float = 0.0


# -- saves -----------------------------------------------------------------------------------------
SAVE_FUNCTIONS = (
    ("torch", "save"),
    ("torch.serialization", "save"),
    ("safetensors.torch", "save_file"),
    ("safetensors.torch", "save"),
    ("safetensors.torch", "save_model"),
    ("transformers.modeling_utils", "safe_save_file"),
)
"""Functions that write checkpoints; each is replaced by one that writes nothing. Modules not
imported yet are imported (safetensors) only when installed; transformers' module is patched
only when the program (or the process) has already imported it."""
SAVE_METHODS = (("transformers.modeling_utils", "PreTrainedModel", "save_pretrained"),)


@contextlib.contextmanager
def skipped_saves(run: ProgramRun) -> Iterator[None]:
    """Checkpoint saves write nothing; where each was asked goes into ``run.skipped_saves``.

    Every module's name for a save function is replaced, and restored, not only the function's
    own module's: peft binds ``from safetensors.torch import save_file as safe_save_file`` when
    imported, so a peft imported before the run saved for real, and one first imported during
    it kept the stub afterwards (a later ``save_pretrained`` in the same process wrote
    nothing: seen in the test suite, test_peft_adapter_is_read_as_shapes after
    tests/test_run_program.py)."""
    restore: list[tuple[Any, str, Any]] = []
    functions: dict[int, tuple[Any, Any]] = {}
    saved = SavedObjects()

    def skip(name: str) -> Callable[..., None]:
        def skipped(*args: Any, **kwargs: Any) -> None:
            where = program_location()
            run.skipped_saves.append(f"{name} at {where}" if where else name)
            if name == "torch.save" and args and (len(args) > 1 or "f" in kwargs):
                saved.remember(args[0], args[1] if len(args) > 1 else kwargs["f"])

        return skipped

    for module_name, attr in SAVE_FUNCTIONS:
        module = sys.modules.get(module_name)
        if module is None and module_name.startswith("safetensors"):
            with contextlib.suppress(ImportError):
                module = importlib.import_module(module_name)
        if module is not None and hasattr(module, attr):
            original = getattr(module, attr)
            if id(original) not in functions:
                # torch.serialization.save is torch.save: one stub, named torch.save
                functions[id(original)] = (original, skip(f"{module_name.split('.')[0]}.{attr}"))
    replace_everywhere(functions)
    for module_name, cls_name, attr in SAVE_METHODS:
        cls = getattr(sys.modules.get(module_name), cls_name, None)
        if cls is not None:
            restore.append((cls, attr, cls.__dict__[attr]))
            setattr(cls, attr, skip(f"{cls_name}.{attr}"))
    try:
        with saved.loads_answered():
            yield
    finally:
        replace_everywhere({id(stub): (stub, original) for original, stub in functions.values()})
        for owner, attr, original in reversed(restore):
            setattr(owner, attr, original)


def skipped_saves_note(saves: list[str]) -> str:
    """One note for the saves skipped, each place once with how many times."""
    counts: dict[str, int] = {}
    for where in saves:
        counts[where] = counts.get(where, 0) + 1
    return (
        "checkpoint saves skipped (nothing written; a torch.load of one in the same run gets new tensors of its layout): "
        + "; ".join(f"{where} ({n} times)" if n > 1 else where for where, n in counts.items())
    )


# -- running ---------------------------------------------------------------------------------------
def _target(spec: ProgramSpec) -> tuple[str, Callable[[], Any]]:
    """``sys.argv[0]`` and a callable that runs the program."""
    if spec.module:
        # finding a dotted module imports its packages: as `python -m` does, with the program's
        # sys.argv and the current folder first on sys.path (a package that binds sys.argv[1:]
        # at import, as torchtitan 0.2's ConfigManager.parse_args default does, sees its own)
        with _argv_and_path(spec.program, spec.args, script=False):
            found = importlib.util.find_spec(spec.program)
        if found is None:
            raise InputError(f"no module named {spec.program!r}", hint="check the -m MODULE name")
        return spec.program, lambda: runpy.run_module(
            spec.program, run_name="__main__", alter_sys=True
        )
    path = Path(spec.program)
    if path.suffix == ".py" or path.exists():
        if not path.is_file():
            raise InputError(
                f"no program {spec.program!r}",
                hint="give a .py file, -m MODULE or a console script",
            )
        return str(path), lambda: runpy.run_path(str(path), run_name="__main__")
    scripts = importlib.metadata.entry_points(group="console_scripts", name=spec.program)
    if not scripts:
        raise InputError(
            f"{spec.program!r} is not a .py file, a module (-m) or an installed console script",
            hint="give the script's path, -m MODULE, or the command's name",
        )
    entry = next(iter(scripts))
    return spec.program, lambda: entry.load()()


def _package_folders(spec: ProgramSpec) -> list[str]:
    """The folders of the installed package whose console script ``spec`` runs (none for a
    ``.py`` file or a module)."""
    if spec.module or Path(spec.program).suffix == ".py" or Path(spec.program).exists():
        return []
    scripts = importlib.metadata.entry_points(group="console_scripts", name=spec.program)
    found = importlib.util.find_spec(next(iter(scripts)).module.split(".")[0]) if scripts else None
    folders = (found.submodule_search_locations or []) if found is not None else []
    return [str(Path(f).resolve()) + os.sep for f in folders]


@contextlib.contextmanager
def _scripts_followed() -> Iterator[None]:
    """A file run with ``runpy.run_path`` while the program runs is the program's
    (``PROGRAM_DIRS``)."""
    run_path = runpy.run_path

    def followed(path_name: Any, *args: Any, **kwargs: Any) -> Any:
        folder = str(Path(path_name).resolve().parent) + os.sep
        if folder not in PROGRAM_DIRS:
            PROGRAM_DIRS.append(folder)
        return run_path(path_name, *args, **kwargs)

    runpy.run_path = followed
    try:
        yield
    finally:
        runpy.run_path = run_path


@contextlib.contextmanager
def _argv_and_path(argv0: str, args: tuple[str, ...], script: bool) -> Iterator[None]:
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [argv0, *args]
    # python puts the script's folder (or the current one, for -m) first on sys.path
    sys.path.insert(0, str(Path(argv0).resolve().parent) if script else os.getcwd())
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


@contextlib.contextmanager
def _default_device_kept() -> Iterator[None]:
    """``torch.set_default_device`` in the program is undone when it ends: it leaves a
    ``DeviceContext`` mode on the process's function-mode stack, above the emulation's (which
    its exit would then pop instead), and a later ``torch.compile`` in the same process fails
    in Dynamo under it ("Missing hash_impl override": seen with LitGPT's pretrain run after
    tests/programs/default_device.py, which ends with ``set_default_device("cpu")``)."""
    import torch

    state = torch._GLOBAL_DEVICE_CONTEXT
    before = getattr(state, "device_context", None)
    try:
        yield
    finally:
        if getattr(state, "device_context", None) is not before:
            torch.set_default_device(None if before is None else before.device)


@contextlib.contextmanager
def _children_seen(run: ProgramRun) -> Iterator[None]:
    """Record the Python processes the program starts (``subprocess.Popen`` of an interpreter):
    a launcher (``accelerate launch``, ``trl sft``) trains in a child, which runs without
    vramledger."""
    import shlex
    import subprocess

    original = subprocess.Popen.__init__

    def init(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = shlex.split(args) if isinstance(args, str) else [os.fspath(a) for a in args]
        if argv and is_interpreter(argv[0]):
            run.children.append(shlex.join(argv))
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]


def children_note(children: list[str]) -> str:
    """What the answer says of the Python processes the program started."""
    first = children[0] if len(children[0]) <= 200 else children[0][:197] + "..."
    return (
        f"the program started {len(children)} Python process"
        f"{'es' if len(children) != 1 else ''} that vramledger does not follow ({first}): "
        "what they allocate is not in this answer; run that command under vramledger "
        "(`vramledger run -- python SCRIPT ...`, or -m MODULE)"
    )


@contextlib.contextmanager
def _alarm(seconds: float | None) -> Iterator[None]:
    """Raise ``StopProgram('timeout')`` in the main thread after ``seconds``."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise StopProgram("timeout")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _StepCounter:
    """Counts the program's optimizer steps (``torch.optim``'s global step hooks) into ``run``,
    names each optimizer, tells ``hooks`` and stops the program after ``max_steps``."""

    def __init__(self, run: ProgramRun, hooks: StepHooks | None, max_steps: int) -> None:
        self.run, self.hooks, self.max_steps = run, hooks, max_steps
        # by the object, not id(): an optimizer made after another is freed can reuse its id
        self.optimizers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.counts: dict[str, int] = {}
        # an optimizer whose step steps others (torchtitan's OptimizersContainer, an Optimizer
        # over each model part's AdamW) takes one step: the outermost, the one the program calls
        self.depth = 0
        # optimizers stepped inside a backward (one per parameter, from gradient hooks) make one
        # training step, which ends when that backward ends
        self.backward_task: int | None = None
        self.backward_group: int | None = None
        self.in_backward = False

    def pre(self, optimizer: Any, _args: Any, _kwargs: Any) -> tuple[tuple, dict[str, Any]] | None:
        run, counts = self.run, self.counts
        self.depth += 1
        if self.depth > 1:
            return None
        import torch

        task = torch._C._current_graph_task_id()
        if task != -1:  # inside autograd's engine: a step made by a gradient hook
            self._in_backward(optimizer, task)
            return None
        if optimizer not in self.optimizers:
            self.optimizers[optimizer] = len(run.optimizer_names)
            name = type(optimizer).__name__
            counts[name] = counts.get(name, 0) + 1
            variable = program_name_of(optimizer)
            run.optimizer_names.append(
                f"{name} ({variable})"
                if variable
                else name
                if counts[name] == 1
                else f"{name} #{counts[name]}"
            )
        if self.hooks is not None:
            self.hooks.before_step(optimizer, run.steps + 1)
            return self._closure_wrapped(optimizer, _args, _kwargs)
        return None

    def _closure_wrapped(
        self, optimizer: Any, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]] | None:
        """The step's arguments with its closure given to the hooks to wrap (a global step
        pre-hook may return new arguments), or None where it has none."""
        assert self.hooks is not None
        if args and callable(args[0]):
            return (self.hooks.closure(optimizer, args[0]), *args[1:]), kwargs
        if callable(kwargs.get("closure")):
            return args, {**kwargs, "closure": self.hooks.closure(optimizer, kwargs["closure"])}
        return None

    def _in_backward(self, optimizer: Any, task: int) -> None:
        """A step inside the backward of graph task ``task``: the first of that backward
        begins a training step, which ends when the backward does (``_backward_ended``)."""
        import torch

        run = self.run
        if self.backward_task != task:
            self.backward_task = task
            if self.backward_group is None:
                self.backward_group = len(run.optimizer_names)
                run.optimizer_names.append(
                    f"{type(optimizer).__name__} (one per parameter, stepped in backward)"
                )
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        self.in_backward = True
        if self.hooks is not None:
            self.hooks.before_step_in_backward(optimizer, run.steps + 1)

    def _backward_ended(self) -> None:
        run = self.run
        self.backward_task = None
        run.steps += 1
        assert self.backward_group is not None
        run.optimizer_of_step[run.steps] = self.backward_group
        if self.hooks is not None:
            self.hooks.after_step(None, run.steps)
        if run.steps >= self.max_steps:
            raise StopProgram("max-steps")

    def post(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        run, hooks = self.run, self.hooks
        self.depth -= 1
        if self.depth > 0:
            if hooks is not None:
                hooks.stepped_within(optimizer)
            return
        if self.in_backward:
            self.in_backward = False
            if hooks is not None:
                hooks.after_step_in_backward(optimizer, run.steps + 1)
            return
        run.steps += 1
        run.optimizer_of_step[run.steps] = self.optimizers[optimizer]
        if hooks is not None:
            hooks.after_step(optimizer, run.steps)
        if run.steps >= self.max_steps:
            raise StopProgram("max-steps")


def launch(spec: ProgramSpec, hooks: StepHooks | None = None) -> ProgramRun:
    """Run the program to its end, to ``spec.max_steps`` optimizer steps, or to
    ``spec.timeout``; raise :class:`ProgramFailed` if it raises."""
    import time

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    argv0, target = _target(spec)
    PROGRAM_DIRS[:] = _package_folders(spec)
    run = ProgramRun()
    counter = _StepCounter(run, hooks, spec.max_steps)
    start = time.perf_counter()
    handles = [
        register_optimizer_step_pre_hook(counter.pre),
        register_optimizer_step_post_hook(counter.post),
    ]
    try:
        with (
            _argv_and_path(argv0, spec.args, script=not spec.module),
            _default_device_kept(),
            _scripts_followed(),
            skipped_saves(run),
            _children_seen(run),
            _alarm(spec.timeout),
        ):
            target()
    except StopProgram as stop:
        run.ending = stop.ending
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0):
            run.exit_code = code if isinstance(code, int) else 1
            if not isinstance(code, int):
                print(code, file=sys.stderr)
    except VramledgerError:
        raise
    except Exception as exc:
        failed = ProgramFailed(exc, program_traceback(exc), run.steps)
        failed.children = run.children
        raise failed from exc
    finally:
        for handle in handles:
            handle.remove()
        PROGRAM_DIRS.clear()
        run.seconds = time.perf_counter() - start
    return run
