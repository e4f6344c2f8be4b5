"""The page's form, made from the TrainingSpec fields as the command line's options are
(``cli/options.py``): one input per option, in the same sections, its help the field's
docstring, its default and choices the option's; and the form's words read back by the same
argparse options, so the page takes what the CLI takes and refuses it in the CLI's words.

Nothing here names an option the page offers: a field added to the spec is on the page, unless
:data:`NOT_ON_PAGE` says why not. Fields that name Python code (:data:`CODE_FIELDS`, the options
whose metavar is ``spec_fields.CODE``) are asked for beside the model function, and only from a
server started with ``--allow-code``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping
from dataclasses import Field, dataclass
from typing import Any, Literal

from vramledger.cli.options import (
    add_spec_options,
    is_positional,
    option_kwargs,
    shown_default,
    spec_fields,
    spec_values,
)
from vramledger.inputs.errors import InputError
from vramledger.inputs.spec_fields import CODE, Section, cli_of, option_flag

NOT_ON_PAGE: dict[str, str] = {
    "deepspeed": "a file the server would read: the CLI's --deepspeed",
    "accelerate_config": "a file the server would read: the CLI's --accelerate-config",
    "seed": "seeds real runs (measure, rehearse); the page's answers are traces",
}
"""Spec options the page does not offer, each with the reason (the model is the page's source
boxes)."""

Kind = Literal["switch", "number", "choice", "text"]


@dataclass(frozen=True, kw_only=True)
class FormField:
    """One input of the page: a spec option as the page asks for it."""

    name: str
    """The TrainingSpec field (the input's ``data-field``)."""
    section: Section
    kind: Kind
    """switch (a checkbox), number, choice (a list to pick from), or text (a word, a list of
    names separated by commas, or JSON, as on the command line)."""
    value: str
    """What the input holds at first: the option's default ('' for none)."""
    code: bool = False
    """The option names Python code (``FILE.py:FUNCTION``): asked for beside the model
    function, only from a server started with ``--allow-code``."""
    choices: tuple[str, ...] = ()
    offered: tuple[str, ...] = ()
    """Words suggested for a text input (the spec checks what is typed)."""
    placeholder: str = ""
    help: str = ""
    """The option's ``--help`` text."""


def _form_field(f: Field) -> FormField:
    kwargs = option_kwargs(f)
    form = cli_of(f)
    assert form is not None
    kind: Kind = "text"
    if kwargs.get("action") == "store_true":
        kind = "switch"
    elif form.choices is not None:
        kind = "choice"
    elif kwargs.get("type") is int:
        kind = "number"
    return FormField(
        name=f.name,
        section=form.section,
        kind=kind,
        value=shown_default(f) or "",
        code=form.metavar == CODE,
        choices=tuple(form.choices or ()),
        offered=tuple(form.offered()) if form.offered is not None else (),
        placeholder=form.metavar or "",
        help=kwargs["help"].replace("%%", "%"),  # argparse's escape undone
    )


@functools.cache
def form_fields() -> dict[str, FormField]:
    """The page's inputs by spec field, in the spec's order: every option of the spec but the
    model and :data:`NOT_ON_PAGE`."""
    return {
        f.name: _form_field(f)
        for f in spec_fields()
        if not is_positional(f) and f.name not in NOT_ON_PAGE
    }


CODE_FIELDS: tuple[str, ...] = tuple(name for name, f in form_fields().items() if f.code)
"""Spec fields that name Python code (``FILE.py:FUNCTION``): taken only from a server started
with ``--allow-code DIR``, from files under DIR, as the model is."""


class _Refusing(argparse.ArgumentParser):
    """argparse that raises the line it would print, instead of printing it and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise InputError(message)


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The command line's spec options, but the model and :data:`NOT_ON_PAGE`."""
    parser = _Refusing(add_help=False, allow_abbrev=False)
    positional = tuple(f.name for f in spec_fields() if is_positional(f))
    add_spec_options(parser, exclude=(*positional, *NOT_ON_PAGE))
    return parser


def spec_words(form: Mapping[str, Any]) -> dict[str, Any]:
    """The spec fields the form sets, read as the CLI reads the same words: the page's
    ``{field: text or checked}`` given to the options as ``--field=text`` (``--field`` for a
    checked switch); an empty input is an option not given. A code field's value is the
    reference as typed (the caller resolves it under the code folder)."""
    fields = form_fields()
    argv, given = [], []
    for name, value in form.items():
        if name not in fields:
            raise InputError(f"the page takes no field {name!r}")
        option = option_flag(name)
        if fields[name].kind == "switch":
            if not isinstance(value, bool):
                raise InputError(f"{option[2:]} must be true or false, not {value!r}")
            if value:
                argv.append(option)
                given.append(name)
            continue
        if value is None or isinstance(value, bool):
            continue
        text = str(value).strip()
        if text:
            argv.append(f"{option}={text}")
            given.append(name)
    values = spec_values(_parser().parse_args(argv))
    return {name: values[name] for name in given}
