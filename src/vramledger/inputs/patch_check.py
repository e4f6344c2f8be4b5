"""The patch registry checked against the installed libraries: for each :class:`Patch`, whether
its package is installed, in its tested range, and whether what it replaces is still there.

A target is resolved by importing the longest importable module of its dotted path and walking
the rest as attributes (``torch.nn.Module._apply``: ``torch.nn``, then ``Module``, then
``_apply``); a ``*`` in the last part matches any name (``fnmatch``). Nothing is called, and
nothing is patched: the libraries are imported, which is what costs (DeepSpeed's import takes
seconds; its log line goes to standard error). ``vramledger compat`` renders the answer
(``render/patches.py``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import platform
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from vramledger.inputs.compat import installed_version, release
from vramledger.inputs.patches import PATCHES, PYTHON, Patch, tested_range

PatchStatus = Literal["present", "missing", "absent", "not installed", "untested version"]
"""``present``: the target resolves; ``missing``: it does not, though its package is installed
in its tested range (a failure); ``absent``: it does not, and the patch does without it
(``Patch.required`` False); ``not installed``: its package is not; ``untested version``: its
package is installed outside its tested range (whether the target resolves is in ``found``)."""

FAILING: tuple[PatchStatus, ...] = ("missing",)
"""Statuses that make the check fail (``vramledger compat`` exits non-zero)."""


@dataclass(frozen=True, kw_only=True)
class PatchCheck:
    """One patch, checked."""

    patch: Patch
    """The registry's entry."""
    version: str | None
    """Its package's installed version; None when it is not installed."""
    in_range: bool | None
    """Whether ``version`` is in the package's tested range; None when it is not installed or
    has no tested range."""
    found: bool | None
    """Whether ``patch.checked`` resolves; None when its package is not installed (nothing was
    imported)."""
    detail: str = ""
    """Why it does not resolve: the part not found, or the import's error."""

    @property
    def status(self) -> PatchStatus:
        if self.version is None:
            return "not installed"
        if self.in_range is False:
            return "untested version"
        if self.found:
            return "present"
        return "missing" if self.patch.required else "absent"

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.patch.to_dict(),
            "status": self.status,
            "version": self.version,
            "in_range": self.in_range,
            "found": self.found,
            "detail": self.detail,
        }


@dataclass(frozen=True, kw_only=True)
class PatchReport:
    """Every patch of the registry, checked (:func:`check_patches`)."""

    checks: tuple[PatchCheck, ...]
    """One per patch, in the registry's order."""

    @property
    def failed(self) -> tuple[PatchCheck, ...]:
        """Patches whose target is missing from an installed package in its tested range."""
        return tuple(c for c in self.checks if c.status in FAILING)

    def packages(self) -> dict[str, dict[str, Any]]:
        """Package -> its version, tested range and how many of its patches are in each status
        (the package with the most patches first)."""
        out: dict[str, dict[str, Any]] = {}
        for check in self.checks:
            package = check.patch.package
            if package not in out:
                tested = tested_range(package)
                out[package] = {
                    "version": check.version,
                    "tested_range": None if tested is None else f">={tested[0]},<{tested[1]}",
                    "in_range": check.in_range,
                    "patches": 0,
                    "statuses": {},
                }
            entry = out[package]
            entry["patches"] += 1
            entry["statuses"][check.status] = entry["statuses"].get(check.status, 0) + 1
        return dict(sorted(out.items(), key=lambda item: -item[1]["patches"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.failed,
            "packages": self.packages(),
            "patches": [c.to_dict() for c in self.checks],
        }


def package_version(package: str) -> str | None:
    """The installed version of a distribution (the interpreter's for ``python``)."""
    return platform.python_version() if package == PYTHON else installed_version(package)


def _in_range(package: str, version: str) -> bool | None:
    tested = tested_range(package)
    if tested is None:
        return None
    return release(tested[0]) <= release(version) < release(tested[1])


def resolve(path: str) -> tuple[bool, str]:
    """Whether the dotted ``path`` names something in the installed libraries, and if not, why
    (module docstring)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        if any("*" in p or "<" in p for p in parts[:cut]):
            continue
        try:
            # libraries log to standard output as they import (DeepSpeed's accelerator)
            with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                owner: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name) and cut > 1:
                continue  # not a module: an attribute of a shorter one
            return False, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a library that fails to import
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return False, f"importing {module_name}: {type(exc).__name__}: {first}"
        return _walk(owner, module_name, parts[cut:])
    return False, f"no module of {path}"


def _walk(owner: Any, name: str, rest: list[str]) -> tuple[bool, str]:
    """``owner`` (named ``name``) then each attribute of ``rest``; a glob as the last part
    matches any of the owner's names."""
    for index, part in enumerate(rest):
        if "*" in part and index == len(rest) - 1:
            names = [n for n in dir(owner) if fnmatch.fnmatchcase(n, part)]
            return (True, "") if names else (False, f"{name} has no attribute matching {part!r}")
        try:
            owner = getattr(owner, part)
        except Exception:
            return False, f"{name} has no attribute {part!r}"
        name = f"{name}.{part}"
    return True, ""


def check_patch(patch: Patch) -> PatchCheck:
    """``patch`` checked against what is installed (nothing imported when its package is
    not installed)."""
    version = package_version(patch.package)
    if version is None:
        return PatchCheck(patch=patch, version=None, in_range=None, found=None)
    found, detail = resolve(patch.checked)
    return PatchCheck(
        patch=patch,
        version=version,
        in_range=_in_range(patch.package, version),
        found=found,
        detail=detail,
    )


def check_patches(patches: Iterable[Patch] | None = None) -> PatchReport:
    """Every patch of ``patches`` checked; None: the registry's (:data:`PATCHES`)."""
    return PatchReport(
        checks=tuple(check_patch(p) for p in (PATCHES if patches is None else patches))
    )
