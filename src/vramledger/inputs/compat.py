"""The library versions whose private parts vramledger uses, checked before it touches them.

vramledger drives some libraries below their public API: DeepSpeed's ZeRO engine and its module
globals (``deepspeed.runtime.zero.stage_1_and_2``, ``deepspeed.utils.groups``,
``deepspeed.comm.comm.cdb``), torchao's per-parameter optimizer step and quantization tables
(``torchao.optim.adam.single_param_adam``, ``torchao.optim.subclass_8bit``), bitsandbytes'
optimizer ``init_state`` and its quantized layers' storage, peft's LoRA layer classes, and
accelerate's FSDP2 wrapping (mirrored from ``accelerate.utils.fsdp_utils``). Those parts change
between releases without notice, so each library is used only within the range that was tested
(the same ranges as the extras in ``pyproject.toml``; ``tests/test_compat.py`` keeps the two
equal). Outside it, the first use refuses in one line, naming the range. What vramledger
replaces in these libraries and in torch is listed in ``patches.py`` (``vramledger compat``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from types import ModuleType

from vramledger.inputs.errors import InputError

TESTED_RANGES: dict[str, tuple[str, str]] = {
    "deepspeed": ("0.19", "0.20"),
    "torchao": ("0.10", "0.19"),
    "accelerate": ("1.15", "1.16"),
    "peft": ("0.17", "0.22"),
    "bitsandbytes": ("0.45", "0.51"),
}
"""Package -> (lowest version supported, first version not tested): ``>=low,<high``. CI tests
deepspeed 0.19.8, torchao 0.15.0, accelerate 1.15.0, peft 0.18.1, bitsandbytes 0.50.2 (torchao and
peft as the ``frameworks`` extra pins them for torchtune; torchao 0.18.0 and peft 0.21.2 were
tested before it) (and
transformers 5.24, whose own range, ``<5.25``, is the ``hf`` extra's: 5.25 turns on Hub kernels in
``from_pretrained`` by default)."""

EXTRAS: dict[str, str] = {
    "transformers": "hf",
    "matplotlib": "report",
    "torchao": "lowbit",
    "bitsandbytes": "lowbit",
    "peft": "peft",
    "deepspeed": "deepspeed",
    "starlette": "serve",
    "uvicorn": "serve",
}
"""Each optional package, by its import name -> the vramledger extra that installs it
(pyproject.toml's ``[project.optional-dependencies]``; tests/test_extras.py keeps the two equal; ``extras.py`` checks a request's needs against it).
bitsandbytes is in ``peft`` too (QLoRA); ``lowbit`` is the smaller install."""

ALLOW_UNTESTED = "VRAMLEDGER_ALLOW_UNTESTED_LIBRARIES"
"""Set to 1 to use a version outside its tested range anyway (answers may be wrong or fail)."""

_RELEASE = re.compile(r"\d+(?:\.\d+)*")


def release(text: str) -> tuple[int, ...]:
    """The numeric release of a version string: '0.18.0+cu126' -> (0, 18, 0), '1.15.0.dev0' ->
    (1, 15, 0)."""
    match = _RELEASE.match(text.strip())
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.group().split("."))


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def in_tested_range(package: str, version: str) -> bool:
    low, high = TESTED_RANGES[package]
    return release(low) <= release(version) < release(high)


def check_tested(package: str) -> None:
    """Refuse ``package`` outside its tested range (nothing to check when it is not installed or
    not one of ``TESTED_RANGES``: importing it says what is missing)."""
    if package not in TESTED_RANGES or os.environ.get(ALLOW_UNTESTED) == "1":
        return
    version = installed_version(package)
    if version is None or in_tested_range(package, version):
        return
    low, high = TESTED_RANGES[package]
    raise InputError(
        f"{package} {version} is installed; vramledger uses private parts of {package} and is "
        f"tested with {package}>={low},<{high}",
        hint=f"pip install '{package}>={low},<{high}' (or set {ALLOW_UNTESTED}=1 to try anyway)",
    )


def import_tested(module_name: str) -> ModuleType:
    """``importlib.import_module(module_name)`` after checking its package's version (an
    ImportError passes through for the caller to explain)."""
    check_tested(module_name.split(".")[0])
    return importlib.import_module(module_name)
