"""Bytes are ``int`` everywhere; this is the one place that converts to and from text.

1024-based units are labelled KiB/MiB/GiB/TiB; 1000-based ones (as GPU vendors quote memory)
kB/MB/GB/TB.
"""

from __future__ import annotations

import re

from vramledger.inputs.errors import InputError

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

_UNITS = {
    "b": 1,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, *, allow_zero: bool = False, option: str | None = None) -> int:
    """Parse '24GiB', '80 GB', '512MiB' or a plain integer of bytes. With ``option`` (a user's
    command-line value) a unit is required: '24' is far more likely meant as 24 GiB than as
    24 bytes, so it is refused rather than guessed."""
    match = _PATTERN.match(text)
    if not match:
        raise InputError(
            f"cannot read {text!r} as a memory size", hint="write it like 24GiB or 80GB"
        )
    if option is not None and not match.group(2) and float(match.group(1)) != 0:
        raise InputError(
            f"{option} {text} has no unit",
            hint=f"write {text}GiB (1024-based) or {text}GB (1000-based, as GPU vendors quote)",
        )
    number, unit = float(match.group(1)), match.group(2).lower() or "b"
    if unit not in _UNITS:
        raise InputError(
            f"unknown memory unit {match.group(2)!r} in {text!r}",
            hint="use B, KiB, MiB, GiB, TiB (1024-based) or kB, MB, GB, TB (1000-based)",
        )
    value = round(number * _UNITS[unit])
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"memory size {text!r} must be positive")
    return value


def format_bytes(n: int, *, signed: bool = False) -> str:
    """Human-readable 1024-based size: '1.50 GiB'."""
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    value = abs(n)
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if value >= size:
            return f"{sign}{value / size:.2f} {unit}"
    return f"{sign}{value} B"
