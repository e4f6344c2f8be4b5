"""The command line's spec options, made from the TrainingSpec fields: one option per field,
``--`` and the field's name with dashes, its help the field's docstring (spec_fields.py), its
default the dataclass default, its choices and metavar the field's ``cli(...)`` metadata.

Nothing here names a field: a field added to the spec is an option of every command that takes
the spec. The commands' own options (``--json``, ``fit --max``, ...) are written in parser.py.
"""

from __future__ import annotations

import argparse
import functools
import typing
from dataclasses import MISSING, Field, fields
from typing import Any

from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.spec_fields import SECTIONS, Cli, Section, cli_of, field_docs, option_flag

PYTHON_ONLY: dict[str, str] = {
    "configs_applied": "set by the entry points once --deepspeed / --accelerate-config are read "
    "(launch_configs.py), never by a user",
}
"""TrainingSpec fields the command line does not take, each with the reason. A field without
``cli(...)`` metadata must be named here."""


@functools.cache
def spec_fields() -> tuple[Field, ...]:
    """The TrainingSpec fields the command line takes, in the spec's order."""
    out = []
    for f in fields(TrainingSpec):
        if cli_of(f) is not None:
            out.append(f)
        elif f.name not in PYTHON_ONLY:
            raise AssertionError(
                f"TrainingSpec.{f.name} has no cli(...) metadata and is not in PYTHON_ONLY"
            )
    return tuple(out)


def _form(f: Field) -> Cli:
    form = cli_of(f)
    assert form is not None, f.name
    return form


def section_fields(section: Section) -> tuple[str, ...]:
    """The names of the spec fields of one section."""
    return tuple(f.name for f in spec_fields() if _form(f).section == section)


PARALLEL_OPTIONS = section_fields("parallelism")
"""Spec options that ``plan`` searches itself and ``rehearse`` (one device) does not take."""
GPU_OPTIONS = section_fields("gpu")
"""Spec options of the GPU predicted for, which commands that run on a real device do not take."""
STEP_FIXED_OPTIONS = ("target", "steps")
"""Spec options that ``fit`` and ``plan`` do not take: they answer for CUDA GPUs, at the spec's
default steps."""


def flag(f: Field) -> str:
    """The option that sets the field: ``--batch-size`` for ``batch_size``."""
    return option_flag(f.name)


def is_positional(f: Field) -> bool:
    """A field without a default (the model) is the command's positional argument."""
    return f.default is MISSING and f.default_factory is MISSING


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainingSpec)


def _hint(f: Field) -> Any:
    return _hints()[f.name]


def _is_int(hint: Any) -> bool:
    """``int`` or ``int | None`` (``bool`` is not a whole number here)."""
    kinds = set(typing.get_args(hint)) or {hint}
    return int in kinds and kinds <= {int, type(None)}


def shown_default(f: Field) -> str | None:
    """The default ``--help`` states after the docstring: a word or a number. A None default,
    which the docstring explains, a switch's False and an empty list are not stated."""
    value = f.default
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    return str(value)


def help_text(f: Field) -> str:
    """The field's docstring as one paragraph (reST's double backquotes dropped), then its
    default; ``%`` escaped for argparse."""
    text = " ".join(field_docs(TrainingSpec)[f.name].replace("``", "").split())
    default = shown_default(f)
    if default is not None:
        text += f" Default: {default}."
    return text.replace("%", "%%")


def option_kwargs(f: Field) -> dict[str, Any]:
    """``add_argument``'s keyword arguments for the field (without its flag)."""
    form = _form(f)
    hint = _hint(f)
    kwargs: dict[str, Any] = {"help": help_text(f)}
    if not is_positional(f):
        kwargs["dest"] = f.name
    if hint is bool:
        assert f.default is False, f"{f.name}: a switch turns a False default on"
        kwargs["action"] = "store_true"
    elif typing.get_origin(hint) is tuple:
        kwargs["action"] = "append"
        kwargs["default"] = list(f.default)  # type: ignore[arg-type]
    elif not is_positional(f):
        assert f.default_factory is MISSING or form.convert is not None, (
            f"{f.name}: a default made by a factory needs a convert for the option not given"
        )
        kwargs["default"] = None if f.default is MISSING else f.default
    parse = form.parse or (int if _is_int(hint) else None)
    if parse is not None:
        kwargs["type"] = parse
    if form.metavar is not None:
        kwargs["metavar"] = form.metavar
    if form.choices is not None:
        kwargs["choices"] = form.choices
    return kwargs


def add_spec_options(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """The model and every spec option but those in ``exclude``, in a group per section."""
    groups = {section: parser.add_argument_group(title) for section, title in SECTIONS.items()}
    for f in spec_fields():
        if f.name in exclude:
            continue
        group = groups[_form(f).section]
        names = [f.name] if is_positional(f) else [flag(f)]
        group.add_argument(*names, **option_kwargs(f))


def spec_from_args(args: argparse.Namespace) -> TrainingSpec:
    """The TrainingSpec the parsed options say; an option the command does not take, or one
    not given whose default is None, leaves the spec's default."""
    return TrainingSpec(**spec_values(args))


def spec_values(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainingSpec fields the parsed options set, as the spec takes them (each option's
    ``convert`` applied, repeated options as tuples)."""
    values = {}
    for f in spec_fields():
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        convert = _form(f).convert
        if convert is not None:
            value = convert(value, flag(f))
        elif typing.get_origin(_hint(f)) is tuple:
            value = tuple(value or ())
        if value is not None:
            values[f.name] = value
    return values
