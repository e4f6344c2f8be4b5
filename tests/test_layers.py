"""The floors of the package are its folders: every module sits in the folder of its floor,
imports only from its own floor and those below, and no import cycle exists among modules.

Every ``import`` counts, at module level or inside a function (``ast``, not the interpreter):
a function-level import hides an upward import or a cycle from the interpreter, not from this
test. Function-level imports stay only for optional heavy packages (deepspeed, transformers,
peft, torchao, ...), which are not vramledger modules and are not checked here.

The floors, bottom to top (docs/how-it-works.md's "Layout of the code" section shows the same table):

``inputs/``   what to run: the spec, the readers of foreign configs (DeepSpeed, accelerate,
              Hub configs, users' programs), recipe, sources, GPUs, precision, optimizers, the
              training step, the category vocabulary, errors, units.
``record/``   the record of a run's allocations (``Timeline``) and the allocator models that
              replay it. The tracer writes into a ``Timeline``, so the record sits below it.
``trace/``    fake-tensor tracing: ``core/`` (the tracker and its fixes), ``emulation/`` (device
              policies, the emulated GPU), ``compile/`` (compiled regions), ``program/`` (the
              user's program under the trace).
``ledger/``   a timeline replayed into the ledger (peaks, categories).
``parallel/`` the engines: how ranks share the work (sharding, meshes, pipeline stages,
              DeepSpeed's engine) — no measuring.
``predict/``  fake runs: vramledger's step (``estimate``) and the user's program (``run``).
``measure/``  every real run (CPU, CUDA, local gloo, DeepSpeed, pipeline stages, the user's
              program) and what compares it with a prediction.
``plan/``     what would make a step fit.
``render/``   terminal, HTML, plots.
``cli/``      the command line, and ``serve/`` (its web page) inside it.

Above them, at the package's root, only its entry points: ``__init__`` (the public names),
``__main__`` and ``answer_cache`` (the ``vramledger`` script, which answers a repeated question
before the command line, and torch, are imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "vramledger"

FLOORS = [
    "inputs",
    "record",
    "trace",
    "ledger",
    "parallel",
    "predict",
    "measure",
    "plan",
    "render",
    "cli",
]
"""Bottom to top, each a folder of the package: a module may import from its own floor and the
floors before it."""

ENTRY_POINTS = ["", "__main__", "answer_cache"]
"""The modules at the package's root (``""`` is its ``__init__``): above every floor."""


def _modules() -> dict[str, Path]:
    """Dotted name under ``vramledger`` -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported dotted name (under ``vramledger``) lives in: itself, or the
    longest enclosing module (``from .spec import TrainingSpec`` -> ``spec``)."""
    while True:
        if name in modules:
            return name
        if not name:
            return None
        name = name.rpartition(".")[0]


def _imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """vramledger modules ``module`` imports anywhere in its file -> line of the first import."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(["vramledger", *base])
            else:
                prefix = ""
            source = ".".join(p for p in (prefix, node.module or "") if p)
            names = [f"{source}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name != "vramledger" and not name.startswith("vramledger."):
                continue
            target = _resolve(name.removeprefix("vramledger").removeprefix("."), modules)
            if target is not None and target != module:
                out.setdefault(target, node.lineno)
    return out


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _floor_of() -> dict[str, int]:
    """Module -> index of its floor: the first folder of its path; the entry points above all."""
    out = {}
    for module in _modules():
        if module in ENTRY_POINTS:
            out[module] = len(FLOORS)
        elif (folder := module.partition(".")[0]) in FLOORS:
            out[module] = FLOORS.index(folder)
    return out


def _shown(module: str) -> str:
    return f"vramledger.{module}" if module else "vramledger"


def test_every_module_sits_in_the_folder_of_a_floor():
    floor = _floor_of()
    stray = sorted(set(_modules()) - set(floor))
    assert not stray, (
        f"{', '.join(map(_shown, stray))}: not in a floor's folder; move each into the folder "
        f"of its floor ({', '.join(FLOORS)}; docs/how-it-works.md's 'Layout of the code')"
    )
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(FLOORS), f"the package's folders {folders} are not the floors {FLOORS}"


def test_no_module_imports_from_a_floor_above_its_own():
    floor = _floor_of()
    names = [*FLOORS, "entry point"]
    upward = [
        f"{_shown(m)} ({names[floor[m]]}) imports {_shown(t)} ({names[floor[t]]}), line {line}"
        for m, targets in _graph().items()
        if m in floor
        for t, line in targets.items()
        if t in floor and floor[t] > floor[m]
    ]
    assert not upward, "imports from a floor above:\n" + "\n".join(upward)


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, {})):
            if state.get(t) == 1:
                return [*path[path.index(t) :], t]
            if t not in state and (found := visit(t)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(map(_shown, cycle))


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The parser itself: an import inside a function counts, relative levels resolve, and a
    name imported from a module resolves to that module."""
    package = tmp_path / "vramledger"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("X = 1\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "high.py").write_text("def f():\n    from ..low import X\n    return X\n")
    modules = {"": package, "low": package / "low.py", "sub": package / "sub" / "__init__.py"}
    modules["sub.high"] = package / "sub" / "high.py"
    assert _imports("sub.high", modules["sub.high"], modules) == {"low": 2}
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {}}) is None
