"""The floors of the package: every module sits on one floor, imports only from its own floor and
those below, and no import cycle exists among modules.

Every ``import`` counts, at module level or inside a function (``ast``, not the interpreter):
a function-level import hides an upward import or a cycle from the interpreter, not from this
test. Function-level imports stay only for optional heavy packages (deepspeed, transformers,
peft, torchao, ...), which are not vramledger modules and are not checked here.

The floors, bottom to top (docs/how-it-works.md's "Layout of the code" section shows the same table):

``inputs``    what to run: the spec, the readers of foreign configs (DeepSpeed, accelerate,
              Hub configs, users' programs), recipe, sources, GPUs, precision, optimizers, the
              training step, the category vocabulary, errors, units.
``timeline``  the record of a run's allocations (``Timeline``) and the allocator models that
              replay it. The tracer writes into a ``Timeline``, so the record sits below it.
``trace``     fake-tensor tracing: the tracker, device policies, CUDA emulation.
``ledger``    a timeline replayed into the ledger (peaks, categories).
``engines``   ``parallel/``: how ranks share the work (sharding, meshes, pipeline stages,
              DeepSpeed's engine) — no measuring.
``run``       ``predict`` (fake runs) and ``measure`` (every real run: CPU, CUDA, local gloo,
              DeepSpeed, pipeline stages), and what compares them.
``plan``      ``plan/``: what would make a step fit.
``render``    ``render/``: terminal, HTML, plots.
``cli``       the command line, and ``serve/`` (its web page, beside it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "vramledger"

FLOORS = ["inputs", "timeline", "trace", "ledger", "engines", "run", "plan", "render", "cli"]
"""Bottom to top: a module may import from its own floor and the floors before it."""

LAYERS: dict[str, list[str]] = {
    "inputs": [
        "accelerate_config",
        "adapters",
        "cache",
        "attention",
        "bnb_weights",
        "categories",
        "chatter",
        "checkpoint_shapes",
        "checkpointing",
        "checks",
        "compat",
        "config_depth",
        "config_flags",
        "deepspeed_config",
        "errors",
        "gc_pause",
        "gpus",
        "import_hooks",
        "jsonfile",
        "launch_configs",
        "offline_hub",
        "optimizers",
        "parallelism",
        "precision",
        "program",
        "program_frames",
        "recipe",
        "saved_objects",
        "sources",
        "spec",
        "spec_fields",
        "tasks",
        "torchrun_env",
        "training",
        "units",
        "verdict",
        "version",
    ],
    "timeline": ["allocator", "allocator_events", "event_totals", "timeline"],
    "trace": [
        "trace",
        "trace.autocast_cuda",
        "trace.backward_modules",
        "trace.block_labels",
        "trace.block_regions",
        "trace.blocks",
        "trace.cache",
        "trace.compiled",
        "trace.cpu_kernels",
        "trace.cpu_scratch",
        "trace.cuda_api",
        "trace.cuda_calls",
        "trace.cuda_emulation",
        "trace.cuda_policy",
        "trace.device_mappings",
        "trace.dtensor_compat",
        "trace.eager_regions",
        "trace.engine",
        "trace.fake",
        "trace.trace_errors",
        "trace.fake_corrections",
        "trace.hf_compat",
        "trace.inductor_stub",
        "trace.module_attribution",
        "trace.host_stand_ins",
        "trace.host_tensors",
        "trace.optimizer_stand_ins",
        "trace.paged_states",
        "trace.patched_functions",
        "trace.plain_autograd",
        "trace.plain_branches",
        "trace.premul_sum",
        "trace.policy",
        "trace.program_blocks",
        "trace.program_trace",
        "trace.program_tracker",
        "trace.recording",
        "trace.sdpa_cuda",
        "trace.step_memo",
        "trace.storage_resize",
        "trace.target_policy",
        "trace.tracker",
        "trace.triton_launches",
        "trace.twin_folding",
        "trace.value_operators",
        "trace.value_stand_ins",
        "trace.values",
        "trace.wrapped_numbers",
    ],
    "ledger": ["ledger", "ledger_record", "peak_modules", "replay"],
    "engines": [
        "parallel",
        "parallel.context",
        "parallel.deepspeed_engine",
        "parallel.deepspeed_layout",
        "parallel.deepspeed_runtime",
        "parallel.dtensor_rng",
        "parallel.engines",
        "parallel.experts",
        "parallel.fake_group",
        "parallel.fsdp_chunks",
        "parallel.fsdp_units",
        "parallel.mesh",
        "parallel.pipeline",
        "parallel.pipeline_models",
        "parallel.pipeline_rank",
        "parallel.pipeline_stages",
        "parallel.pipeline_step",
        "parallel.program_deepspeed",
        "parallel.program_pipeline",
        "parallel.program_tp",
        "parallel.program_world",
        "parallel.real",
        "parallel.strategy",
        "parallel.tp_plans",
    ],
    "run": [
        "",  # the package itself: estimate and the public names
        "attribution",
        "compare",
        "cpu_allocator_count",
        "measure",
        "measure.counting",
        "measure.deepspeed",
        "measure.local",
        "measure.pipeline",
        "measure_program",
        "other_gpu",
        "predict",
        "predict_program",
        "windows",
    ],
    "plan": [
        "plan",
        "plan.advise",
        "plan.candidates",
        "plan.derive",
        "plan.derived_peaks",
        "plan.fit",
        "plan.fit_estimates",
        "plan.layouts",
        "plan.narrow",
        "plan.planner",
        "plan.rehearse",
        "plan.result",
        "plan.runner",
        "plan.search",
        "plan.worker_preload",
        "plan.workers",
    ],
    "render": [
        "render",
        "render.charts",
        "render.html",
        "render.planning",
        "render.plots",
        "render.program",
        "render.snapshot",
        "render.terminal",
    ],
    "cli": [
        "__main__",
        "answer_cache",
        "cli",
        "cli.__main__",
        "cli.commands",
        "cli.options",
        "cli.parser",
        "cli.report",
        "serve",
        "serve.app",
        "serve.dispatch",
        "serve.page",
        "serve.question",
        "serve.worker",
    ],
}
"""Module (dotted, under ``vramledger``; ``""`` is the package's ``__init__``) by floor."""


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
    return {m: FLOORS.index(floor) for floor, ms in LAYERS.items() for m in ms}


def _shown(module: str) -> str:
    return f"vramledger.{module}" if module else "vramledger"


def test_every_module_has_a_floor():
    floor = _floor_of()
    assert list(LAYERS) == FLOORS
    missing = sorted(set(_modules()) - set(floor))
    assert not missing, (
        f"{', '.join(map(_shown, missing))}: not in tests/test_layers.py's LAYERS; add each to "
        "the floor it belongs to (and to docs/how-it-works.md's 'Layout of the code' table if it starts a "
        "new kind)"
    )
    gone = sorted(set(floor) - set(_modules()))
    assert not gone, f"LAYERS lists modules that no longer exist: {', '.join(map(_shown, gone))}"


def test_no_module_imports_from_a_floor_above_its_own():
    floor = _floor_of()
    upward = [
        f"{_shown(m)} ({FLOORS[floor[m]]}) imports {_shown(t)} ({FLOORS[floor[t]]}), line {line}"
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
