"""The optional libraries a request needs (pyproject.toml's extras), checked before any work.

vramledger imports an optional library where it first uses it: peft when the model is built with
``--lora``, DeepSpeed's engine when it wraps the model, torchao when its optimizer is made,
matplotlib when the plot is drawn. Found missing there, the answer came after the work before
it: ``compare --plot`` without matplotlib trained both optimizers first (80 s on
tests/fixtures/tiny-llama.json), ``compare --optimizers adamw,sgd,adamw8bit`` without torchao
trained two (71 s). :func:`check_extras` reads the request against one table, :data:`NEEDS`
(option -> package; a package's extra is :data:`EXTRAS`'), before anything is built, and
refuses in one line naming each missing package with the ``pip install`` that adds it; an
installed package outside its tested range is refused the same way (``compat.check_tested``).
The imports where each library is used keep their own messages, for the Python API.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramledger.inputs.compat import EXTRAS, check_tested
from vramledger.inputs.errors import InputError


@dataclass(frozen=True)
class Need:
    """An optional package a request needs, and the option that asked for it."""

    option: str
    """As the user wrote it: ``--lora``, ``--optimizer adamw8bit``, ``--strategy zero2``."""
    package: str


COMMAND_NEEDS: dict[str, str] = {"plot": "matplotlib"}
"""A command's own options (not the spec's) that need an optional package: the option's name
(``--plot``) -> the package."""


def _hf_config(spec: Any) -> str | None:
    """A config.json or a folder holding one: transformers builds the model."""
    model = spec.model
    if isinstance(model, (str, Path)) and (str(model).endswith(".json") or Path(model).is_dir()):
        return "a Hugging Face config"
    return None


def _deepspeed_engine(spec: Any) -> str | None:
    """zero0..zero3 run DeepSpeed's engine, asked for by --strategy or a --deepspeed
    config's stage."""
    if not spec.parallelism.is_deepspeed:
        return None
    if spec.deepspeed:
        return f"--deepspeed {spec.deepspeed} ({spec.strategy}, DeepSpeed's own engine)"
    return f"--strategy {spec.strategy} (DeepSpeed's own engine)"


NEEDS: tuple[tuple[str, Callable[[Any], str | None]], ...] = (
    ("transformers", _hf_config),
    ("peft", lambda spec: "--lora" if spec.lora is not None else None),
    ("bitsandbytes", lambda spec: f"--quantize {spec.quantize}" if spec.quantize else None),
    ("deepspeed", _deepspeed_engine),
)
"""The spec's fields that need an optional package: (its import name, a key of ``EXTRAS``;
the option that asks for it as the user wrote it, or None when the spec does not). The spec is
read with its launch config files applied (a ``--deepspeed`` config of stage 0-2 runs
DeepSpeed's engine). ``--optimizer`` needs what its name names (:func:`optimizer_package`)."""


def optimizer_package(name: Any) -> str | None:
    """The optional package an optimizer name needs (``optimizers.py``'s names and prefixes, an
    import path's top package), without importing it; None for torch.optim's and classes."""
    from vramledger.inputs.optimizers import LIBRARY_OPTIMIZERS, PREFIXES

    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    if key in LIBRARY_OPTIMIZERS:
        path = LIBRARY_OPTIMIZERS[key][0]
    elif any(key.startswith(prefix) for prefix in PREFIXES):
        path = next(m for p, m in PREFIXES.items() if key.startswith(p))
    elif ":" in name and not name.partition(":")[0].endswith(".py"):
        path = name.partition(":")[0]
    elif "." in name and ":" not in name:
        path = name
    else:
        return None
    top = path.split(".")[0]
    return top if top in EXTRAS else None


def spec_needs(spec: Any) -> list[Need]:
    """What ``spec`` needs of :data:`EXTRAS`: by :data:`NEEDS`, and its ``--optimizer``."""
    out = [Need(asked, package) for package, option in NEEDS if (asked := option(spec))]
    return out + optimizer_needs([spec.optimizer], "--optimizer")


def optimizer_needs(names: Iterable[str], flag: str = "--optimizers") -> list[Need]:
    """What a command's list of optimizers (compare's, plan's, fit's ``--optimizers``) needs."""
    out = []
    for name in names:
        package = optimizer_package(name)
        if package is not None:
            out.append(Need(f"{flag} {name}", package))
    return out


def option_needs(options: dict[str, Any]) -> list[Need]:
    """What the command options given (name -> value, None or False when not given) need, by
    :data:`COMMAND_NEEDS`."""
    return [
        Need(f"--{name.replace('_', '-')}", package)
        for name, package in COMMAND_NEEDS.items()
        if options.get(name)
    ]


def installed(package: str) -> bool:
    """Whether ``package`` can be imported (``sys.modules[package] = None`` counts as not)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing; a module without __spec__
        return False


def check_extras(needs: Iterable[Need]) -> None:
    """Refuse in one line when a package ``needs`` names is not installed (every missing one,
    each with what asked for it, and one ``pip install`` for their extras), or is installed
    outside its tested range."""
    needs = list(needs)
    missing: dict[str, list[str]] = {}
    for need in needs:
        if not installed(need.package):
            missing.setdefault(need.package, []).append(need.option)
    if missing:
        said = _and([f"{_and(asked)} needs {package}" for package, asked in missing.items()])
        extras = ",".join(dict.fromkeys(EXTRAS[p] for p in missing))
        which = "which is" if len(missing) == 1 else "which are"
        raise InputError(
            f"{said}, {which} not installed", hint=f"pip install 'vramledger[{extras}]'"
        )
    for package in dict.fromkeys(need.package for need in needs):
        check_tested(package)


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
