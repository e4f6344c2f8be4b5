"""The libraries whose private parts vramledger uses are held to the tested versions: the
ranges in compat.py are pyproject's, the installed versions are inside them, and a version
outside is refused in one line wherever vramledger would first touch it."""

import re
from pathlib import Path

import pytest

from vramledger.cli import main
from vramledger.inputs import compat
from vramledger.inputs.adapters import _require
from vramledger.inputs.errors import InputError
from vramledger.inputs.optimizers import resolve_optimizer
from vramledger.parallel.deepspeed_runtime import deepspeed_modules

from .conftest import fixture

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _declared() -> dict[str, set[tuple[str, str]]]:
    """Package -> every (low, high) range pyproject's extras give it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    found: dict[str, set[tuple[str, str]]] = {}
    for requirement in (r for reqs in extras.values() for r in reqs):
        match = re.fullmatch(r"([A-Za-z0-9_-]+)>=([\d.]+),<([\d.]+)", requirement)
        if match:
            found.setdefault(match[1], set()).add((match[2], match[3]))
    return found


def test_ranges_are_pyprojects():
    declared = _declared()
    for package, tested in compat.TESTED_RANGES.items():
        assert declared.get(package) == {tested}, package


def test_the_installed_versions_are_the_tested_ones():
    for package in compat.TESTED_RANGES:
        version = compat.installed_version(package)
        assert version is not None and compat.in_tested_range(package, version), package


def test_release_reads_local_and_dev_versions():
    assert compat.release("0.18.0+cu126") == (0, 18, 0)
    assert compat.release("1.15.0.dev0") == (1, 15, 0)
    assert compat.in_tested_range("deepspeed", "0.19.8")
    assert not compat.in_tested_range("deepspeed", "0.20.0")
    assert not compat.in_tested_range("torchao", "0.9.1")


@pytest.fixture
def untested(monkeypatch):
    """Pretend ``package`` is installed at ``version``."""
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)

    def pretend(package, version):
        real = compat.installed_version
        monkeypatch.setattr(
            compat, "installed_version", lambda p: version if p == package else real(p)
        )

    return pretend


def test_refused_in_one_line_with_the_range(untested):
    untested("peft", "0.22.0")
    with pytest.raises(InputError) as exc:
        compat.check_tested("peft")
    line = exc.value.one_line()
    assert "\n" not in line
    assert "peft 0.22.0 is installed" in line and "pip install 'peft>=0.17,<0.22'" in line


def test_each_touch_point_refuses(untested, monkeypatch):
    untested("torchao", "0.19.0")
    with pytest.raises(InputError, match=re.escape("torchao>=0.10,<0.19")):
        resolve_optimizer("adamw8bit")
    with pytest.raises(InputError, match=re.escape("torchao>=0.10,<0.19")):
        resolve_optimizer("torchao.optim.AdamW4bit")
    untested("bitsandbytes", "0.51.0")
    with pytest.raises(InputError, match=re.escape("bitsandbytes>=0.45,<0.51")):
        resolve_optimizer("bnb-adamw8bit")
    with pytest.raises(InputError, match=re.escape("bitsandbytes>=0.45,<0.51")):
        _require("bitsandbytes", "lowbit")
    untested("peft", "0.16.0")
    with pytest.raises(InputError, match=re.escape("peft>=0.17,<0.22")):
        _require("peft", "peft")
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")
    _require("peft", "peft")  # the escape hatch


def test_cli_refuses_an_untested_deepspeed(untested, capsys):
    untested("deepspeed", "0.20.1")
    deepspeed_modules.cache_clear()
    try:
        args = ["estimate", fixture("tiny-llama.json"), "--seq-len", "16"]
        code = main([*args, "--world-size", "2", "--strategy", "zero2"])
    finally:
        deepspeed_modules.cache_clear()
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0
    assert "deepspeed 0.20.1 is installed" in err and "deepspeed>=0.19,<0.20" in err


@pytest.mark.slow
def test_pip_resolves_every_extra_inside_the_tested_ranges(tmp_path):
    """``pip install 'vramledger[all]'`` as a user runs it (pip's own resolver, a dry run beside
    the installed torch: the package index is reachable in CI) picks a version inside
    ``compat.TESTED_RANGES`` for each of those packages it installs (issue 33: accelerate 1.16
    came with peft, unpinned)."""
    import importlib.metadata
    import json
    import subprocess
    import sys

    constraints = tmp_path / "torch.txt"
    constraints.write_text(f"torch=={importlib.metadata.version('torch').split('+')[0]}\n")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"),
            *("--quiet", "--report", str(report), "-c", str(constraints)),
            f"{PYPROJECT.parent}[all]",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    resolved = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    for package in compat.TESTED_RANGES:
        assert package in resolved, package
        assert compat.in_tested_range(package, resolved[package]), (package, resolved[package])
