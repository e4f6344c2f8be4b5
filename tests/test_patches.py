"""The patch registry (``src/vramledger/inputs/patches.py``) is complete and true of the installed
libraries, and ``vramledger compat`` says when it is not.

- every registered target resolves in this environment (every framework vramledger patches is
  installed here and in CI, in its tested range), through the command a user runs;
- the registry names the same targets as the code that patches them, where the code keeps its
  targets in a constant (``torch.cuda``'s names, the torchrun variables, the save functions...);
- every module of the package with a patching construct is the ``by`` of some patch, or is
  listed in :data:`NOT_PATCHES` with why it patches no library. The constructs are found in the
  source (``ast``): ``mock.patch*`` and ``config.patch``, ``setattr``/``delattr`` on anything but
  ``self``, ``patched_functions``, ``replace_everywhere``, ``torch.library.Library(..., "IMPL")``,
  writes to ``os.environ``, and assignments to an attribute of an imported name (or of a module
  got from ``sys.modules``/``importlib.import_module``, or a loop over such). A replacement made
  on an object got otherwise (``schedule._warmup_p2p`` of a schedule built from a class looked up
  by name) is not seen: the scan is a net, not a proof;
- ``vramledger compat`` exits non-zero and names the target when one is missing from an installed
  package in its tested range (the registry and the versions simulated).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vramledger.cli import main
from vramledger.cli.report import PATCH_MISSING_EXIT
from vramledger.inputs import compat, patch_check, patches
from vramledger.inputs.patches import PATCHES, PYTHON, Patch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vramledger"
PYPROJECT = ROOT / "pyproject.toml"

NOT_INSTALLED_HERE = {
    "lightning-fabric": "the standalone lightning_fabric; the lightning package, installed, "
    "holds the same loader"
}
"""Packages of registered patches that neither this environment nor CI installs."""

NOT_PATCHES = {
    "trace/core/patched_functions.py": "the mechanism: its targets are registered under its "
    "callers (step_memo.py, compiled.py, fsdp_chunks.py)",
    "trace/core/blocks.py": "truncates the block list of a model it builds",
    "parallel/pipeline_models.py": "cuts a pipeline stage out of a model it builds",
    "inputs/adapters.py": "replaces a model's nn.Linear layers by bitsandbytes' and gives fake "
    "parameters their source's quantization attributes",
    "inputs/config_depth.py": "sets fields of a copy of the model's config",
    "plan/narrow.py": "sets fields of a copy of the model's config",
    "inputs/cache.py": "sets vramledger's own VRAMLEDGER_NO_CACHE",
}
"""Modules with a patching construct that replace no library's attribute, and why."""


# -- the registry is true of this environment ------------------------------------------------
@pytest.mark.slow
def test_every_target_resolves_here():
    """``vramledger compat --json`` in a fresh process (it imports every patched library, which
    this test process need not): every patch of an installed package is present, every package
    is installed in its tested range, and the exit status says all is well."""
    done = subprocess.run(
        [sys.executable, "-m", "vramledger.cli", "compat", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    assert answer["ok"]
    assert len(answer["patches"]) == len(PATCHES)
    for package, about in answer["packages"].items():
        if package in NOT_INSTALLED_HERE:
            assert about["version"] is None, package
            continue
        assert about["version"] is not None, f"{package} is not installed"
        assert about["in_range"] is not False, (package, about)
    for entry in answer["patches"]:
        if entry["package"] in NOT_INSTALLED_HERE:
            continue
        expected = "present" if entry["required"] else ("present", "absent")
        assert entry["status"] in expected, entry


def test_resolve_finds_attributes_and_says_what_is_not():
    assert patch_check.resolve("torch.nn.Module._apply") == (True, "")
    assert patch_check.resolve("torch.distributed.distributed_c10d.init_process_group")[0]
    assert patch_check.resolve("torch.ops.aten.scaled_dot_product_attention")[0]
    found, why = patch_check.resolve("torch.nn.Module._no_such_method")
    assert not found and "torch.nn.Module has no attribute '_no_such_method'" in why
    assert patch_check.resolve("torch.nn.modules.module._global_*_hooks")[0]
    assert not patch_check.resolve("torch.nn.modules.module._no_such_*")[0]
    assert not patch_check.resolve("no_such_package_anywhere.x")[0]


# -- the registry is the code's ---------------------------------------------------------------
def _registered(by: str) -> set[str]:
    return {p.target for p in PATCHES if p.by == by}


def test_cuda_names_are_the_emulations():
    import torch.accelerator
    import torch.cuda.memory

    from vramledger.trace.emulation.cuda_api import accelerator_functions, cuda_functions

    class Gpu:
        name, total_memory, major, minor, device_count = "GPU", 1, 9, 0, 1

    cuda = cuda_functions(Gpu(), None)
    accelerator = accelerator_functions(cuda)
    assert set(patches.CUDA_FUNCTIONS) == set(cuda)
    assert set(patches.ACCELERATOR_FUNCTIONS) == set(accelerator)
    assert set(patches.CUDA_MEMORY_FUNCTIONS) == {n for n in cuda if hasattr(torch.cuda.memory, n)}
    assert set(patches.ACCELERATOR_MEMORY_FUNCTIONS) == {
        n for n in accelerator if hasattr(torch.accelerator.memory, n)
    }
    registered = _registered("trace/emulation/cuda_emulation.py")
    for owner, names in (
        ("torch.cuda", cuda),
        ("torch.cuda.memory", patches.CUDA_MEMORY_FUNCTIONS),
        ("torch.accelerator", accelerator),
        ("torch.accelerator.memory", patches.ACCELERATOR_MEMORY_FUNCTIONS),
        ("torch.cuda.nvtx", patches.NVTX_FUNCTIONS),
    ):
        assert {f"{owner}.{n}" for n in names} <= registered, owner


def test_torchrun_variables_are_torchrun_envs():
    from vramledger.inputs.torchrun_env import TorchrunRank

    names = set(TorchrunRank(rank=0, nproc_per_node=2).environment())
    assert set(patches.TORCHRUN_VARIABLES) == names
    assert {f"os.environ[{n!r}]" for n in names} <= _registered("inputs/torchrun_env.py")


def test_parallel_styles_are_torchs():
    from torch.distributed.tensor.parallel import style

    todo, found = [style.ParallelStyle], set()
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "_apply" in cls.__dict__ and cls.__module__ == style.__name__:
            found.add(cls.__name__)
    assert set(patches.PARALLEL_STYLES) == found


def test_targets_kept_in_constants_are_registered():
    """Where the patching module keeps its targets in a constant, each is registered with that
    module as its ``by``."""
    from vramledger.inputs import checkpoint_shapes, program
    from vramledger.parallel import dtensor_rng, fsdp_chunks, program_deepspeed, program_world
    from vramledger.trace.compile import compiled
    from vramledger.trace.core import step_memo

    def dotted(pairs):
        return {".".join(pair[:2]) for pair in pairs}

    expected = {
        "trace/core/step_memo.py": dotted(step_memo.STEP_FUNCTIONS),
        "trace/compile/compiled.py": dotted(compiled.COMPILED_FUNCTIONS),
        "parallel/fsdp_chunks.py": dotted([fsdp_chunks.CHUNK_FUNCTION]),
        "inputs/program.py": dotted(program.SAVE_FUNCTIONS)
        | {".".join(m) for m in program.SAVE_METHODS},
        "inputs/checkpoint_shapes.py": {
            f"{m}._lazy_load" for m in checkpoint_shapes.LIGHTNING_LAZY_LOAD
        },
        "parallel/dtensor_rng.py": {f"{m}.is_rng_supported_mesh" for m in dtensor_rng._OWNERS},
        "parallel/program_world.py": {
            f"{m}._get_device_from_mesh" for m in program_world._FSDP_DEVICE_OWNERS
        },
        "parallel/program_deepspeed.py": {
            f"torch.Tensor.{n}" for n in program_deepspeed.HOOK_REGISTRATIONS
        },
    }
    for by, targets in expected.items():
        assert targets <= _registered(by), (by, targets - _registered(by))


# -- the registry is complete -----------------------------------------------------------------
def _foreign_names(tree: ast.Module) -> set[str]:
    """Names a module binds to another package's modules and objects: its imports (but
    vramledger's), modules got from ``sys.modules`` or ``importlib.import_module``, and
    containers of those and the loop variables over them."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(
                a.asname or a.name.split(".")[0]
                for a in node.names
                if not a.name.startswith("vramledger")
            )
        elif isinstance(node, ast.ImportFrom) and not _ours(node):
            names.update(a.asname or a.name for a in node.names)
    for _ in range(2):  # containers of foreign names, then the loops over them
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _is_foreign(node.value, names):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif (
                isinstance(node, ast.For)
                and isinstance(node.target, ast.Name)
                and isinstance(node.iter, ast.Name)
                and node.iter.id in names
            ):
                names.add(node.target.id)
    return names


def _ours(node: ast.ImportFrom) -> bool:
    """An import from vramledger (relative, or by its name)."""
    return bool(node.level) or (node.module or "").startswith("vramledger")


def _is_foreign(value: ast.expr, names: set[str]) -> bool:
    if isinstance(value, ast.Call):
        return ast.unparse(value.func) in ("sys.modules.get", "importlib.import_module")
    if isinstance(value, ast.Subscript):
        return ast.unparse(value.value) == "sys.modules"
    if isinstance(value, (ast.Tuple, ast.List)):
        return bool(value.elts) and all(_is_foreign(e, names) for e in value.elts)
    if isinstance(value, (ast.ListComp, ast.GeneratorExp)):
        return _is_foreign(value.elt, names)
    return isinstance(value, ast.Name) and value.id in names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _assigned(node: ast.Assign | ast.AugAssign) -> list[ast.expr]:
    todo = list(node.targets) if isinstance(node, ast.Assign) else [node.target]
    out = []
    while todo:
        target = todo.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            todo.extend(target.elts)
        else:
            out.append(target)
    return out


def _is_patching_call(node: ast.Call) -> bool:
    name = ast.unparse(node.func)
    first = ast.unparse(node.args[0]) if node.args else ""
    return (
        name == "patch"
        or name.endswith((".patch", "patch.object", "patch.dict", "patch.multiple"))
        or name.split(".")[-1] in ("patched_functions", "replace_everywhere")
        or (name in ("setattr", "delattr") and first != "self")
        or (name.endswith(".callback") and first in ("setattr", "delattr"))
        or (
            name.endswith("library.Library")
            and len(node.args) > 1
            and ast.unparse(node.args[1]) == "'IMPL'"
        )
        or name in ("os.environ.update", "os.environ.setdefault")
    )


def patching_constructs(path: Path) -> list[tuple[int, str]]:
    """(line, construct) of each patching construct in ``path`` (module docstring)."""
    tree = ast.parse(path.read_text(), str(path))
    foreign = _foreign_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_patching_call(node):
            found.append((node.lineno, ast.unparse(node.func)))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in _assigned(node):
                environment = (
                    isinstance(target, ast.Subscript) and ast.unparse(target.value) == "os.environ"
                )
                if environment or (isinstance(target, ast.Attribute) and _root(target) in foreign):
                    found.append((node.lineno, ast.unparse(target)))
    return sorted(found)


def _modules_patching() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = patching_constructs(path)
        if found:
            out[path.relative_to(PACKAGE).as_posix()] = found
    return out


def test_every_module_that_patches_is_registered():
    registered = {p.by for p in PATCHES}
    unregistered = {
        module: found[:3]
        for module, found in _modules_patching().items()
        if module not in registered and module not in NOT_PATCHES
    }
    assert not unregistered, (
        "modules that patch with no entry in inputs/patches.py (add one per target, or list "
        f"the module in NOT_PATCHES with why it patches no library): {unregistered}"
    )


def test_not_patches_are_still_flagged_and_unregistered():
    flagged = _modules_patching()
    registered = {p.by for p in PATCHES}
    for module in NOT_PATCHES:
        assert module in flagged, f"{module} has no patching construct any more"
        assert module not in registered, module


def test_the_scan_sees_the_constructs(tmp_path):
    source = (
        "import os, sys, torch\n"
        "from unittest import mock\n"
        "from torch import nn\n"
        "def f(x):\n"
        "    owners = [importlib.import_module(n) for n in NAMES]\n"
        "    for owner in owners:\n"
        "        owner.name = x\n"
        "    nn.Module._apply = x\n"
        "    os.environ['A'] = '1'\n"
        "    setattr(torch, 'load', x)\n"
        "    setattr(self, 'ours', x)\n"
        "    x.grad = None\n"
        "    with mock.patch.object(torch, 'save', x):\n"
        "        pass\n"
    )
    path = tmp_path / "m.py"
    path.write_text(source)
    assert [line for line, _ in patching_constructs(path)] == [7, 8, 9, 10, 13]


UNDECLARED = {"safetensors", "huggingface-hub", "lightning-fabric", PYTHON}
"""Patched packages with no tested range (``patches.DECLARED_RANGES``' docstring says why)."""


def test_every_entry_is_well_formed():
    dotted = re.compile(r"[A-Za-z_]\w*(\.[\w*]+)+")
    seen = set()
    for patch in PATCHES:
        assert (PACKAGE / patch.by).is_file(), patch.by
        assert patch.reason and "\n" not in patch.reason, patch.target
        assert (patch.target, patch.by) not in seen, patch.target
        seen.add((patch.target, patch.by))
        if patch.kind in ("environment", "kernel", "closure"):
            assert patch.resolves, patch.target
        assert dotted.fullmatch(patch.checked), patch.checked
        assert (patch.tested_range is None) == (patch.package in UNDECLARED), patch.package


def test_declared_ranges_are_pyprojects():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    requirements = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        requirements.extend(extra)
    declared: dict[str, set[tuple[str, str]]] = {}
    for requirement in requirements:
        if match := re.fullmatch(r"([A-Za-z0-9_-]+)>=([\d.]+),<([\d.]+)", requirement):
            declared.setdefault(match[1], set()).add((match[2], match[3]))
        elif match := re.fullmatch(r"([A-Za-z0-9_-]+)==([\d.]+)", requirement):
            release = [int(p) for p in match[2].split(".")]
            following = ".".join(map(str, [*release[:-1], release[-1] + 1]))
            declared.setdefault(match[1], set()).add((match[2], following))
    for package, tested in patches.DECLARED_RANGES.items():
        assert package not in compat.TESTED_RANGES, package
        assert declared.get(package) == {tested}, (package, declared.get(package))


# -- vramledger compat ------------------------------------------------------------------------
SIMULATED = (
    Patch(target="sys.argv", by="inputs/program.py", reason="here", package=PYTHON),
    Patch(
        target="torch.nn.Module._no_such_method",
        by="trace/core/fake_corrections.py",
        reason="a method torch has renamed",
        package="torch",
    ),
    Patch(
        target="torch.nn.Module._no_such_helper",
        by="trace/core/fake_corrections.py",
        reason="one the patch creates",
        package="torch",
        required=False,
    ),
    Patch(
        target="not_a_package_here.thing",
        by="inputs/program.py",
        reason="a library not installed",
        package="not-a-package-here",
    ),
)


def test_compat_fails_on_a_missing_target(monkeypatch, capsys):
    monkeypatch.setattr(patch_check, "PATCHES", SIMULATED)
    assert main(["compat"]) == PATCH_MISSING_EXIT
    out = capsys.readouterr().out
    assert re.search(r"missing\s+│ torch\.nn\.Module\._no_such_method", out), out
    assert "torch.nn.Module has no attribute '_no_such_method'" in out
    assert re.search(r"absent\s+│ torch\.nn\.Module\._no_such_helper", out)
    assert re.search(r"not installed\s+│ not_a_package_here\.thing", out)
    assert "1 of 4 patched targets missing" in out

    assert main(["compat", "--json"]) == PATCH_MISSING_EXIT
    answer = json.loads(capsys.readouterr().out)
    assert not answer["ok"]
    statuses = {p["target"]: p["status"] for p in answer["patches"]}
    assert statuses == {
        "sys.argv": "present",
        "torch.nn.Module._no_such_method": "missing",
        "torch.nn.Module._no_such_helper": "absent",
        "not_a_package_here.thing": "not installed",
    }


def test_compat_passes_without_missing_targets(monkeypatch, capsys):
    monkeypatch.setattr(patch_check, "PATCHES", SIMULATED[:1] + SIMULATED[2:])
    assert main(["compat", "--all"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"present\s+│ sys\.argv", out)
    assert "3 patched targets: every one of an installed package in its tested range" in out


def test_an_untested_version_is_not_a_failure(monkeypatch, capsys):
    """A package outside its tested range is reported as such, its missing targets too, but
    the check does not fail on them: the version itself is what is untested."""
    monkeypatch.setattr(patch_check, "PATCHES", SIMULATED[:2])
    real = patch_check.installed_version
    monkeypatch.setattr(
        patch_check, "installed_version", lambda p: "2.14.0" if p == "torch" else real(p)
    )
    assert main(["compat", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    missing = next(p for p in answer["patches"] if p["package"] == "torch")
    assert missing["status"] == "untested version"
    assert missing["in_range"] is False and missing["found"] is False
    assert answer["packages"]["torch"]["in_range"] is False
