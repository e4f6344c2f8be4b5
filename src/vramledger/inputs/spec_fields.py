"""What each TrainingSpec field says about itself beyond its type and default: the part of the
spec it belongs to and its form on the command line, carried in ``field(metadata=cli(...))``.

A field is described once, by the docstring under it: :func:`field_docs` reads those docstrings
from the source, and the command line's ``--help`` is made from them (``cli/options.py``), with
the dataclass default, the choices (the spec's own constants, which ``__post_init__`` checks
against) and the metavar given here. So the Python API, the CLI and the JSON echo of the spec
(``TrainingSpec.summary``) are read from the same fields; tests/test_cli_spec.py checks that
the parser agrees with them.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
import json
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import Field, dataclass
from typing import Any, Literal

from vramledger.inputs.errors import InputError

Section = Literal["model", "optimizer", "precision", "step", "parallelism", "adapters", "gpu"]
SECTIONS: dict[Section, str] = {
    "model": "model and inputs",
    "optimizer": "optimizer",
    "precision": "precision and checkpointing",
    "step": "training step",
    "parallelism": "parallelism",
    "adapters": "adapters",
    "gpu": "GPU",
}
"""The parts of a spec, in the order ``--help`` shows them, with their headings there."""

CODE = "FILE.py:FUNCTION"
"""The metavar of the options that name Python code (``--inputs``, ``--loss``, ``--tp-plan``):
what a server without ``--allow-code`` refuses to run (``cli/serve/form.py``)."""

METADATA_KEY = "vramledger.cli"
"""The key of a field's :class:`Cli` in its ``dataclasses.field(metadata=...)``."""


@dataclass(frozen=True, kw_only=True)
class Cli:
    """How a spec field appears on the command line: ``--`` and its name with dashes. Its kind
    follows its type: a ``bool`` is a switch, a ``tuple`` an option that repeats, an ``int`` a
    whole number, anything else a word; a field without a default is a positional argument."""

    section: Section
    """The part of the spec the field belongs to: its group in ``--help``."""
    metavar: str | None = None
    """What ``--help`` calls the word the option takes (default: the name in capitals)."""
    choices: tuple[str, ...] | None = None
    """The only words the option takes: the constant the spec checks the field against."""
    parse: Callable[[str], Any] | None = None
    """One word to a value while parsing; a bad word is a usage error (default: ``int`` for an
    ``int`` field, the word itself otherwise)."""
    convert: Callable[[Any, str], Any] | None = None
    """What parsing gave (None when the option was not given) to the field's value, with the
    option's flag for the message of the ``InputError`` that refuses it."""
    offered: Callable[[], Sequence[str]] | None = None
    """Words to suggest where the field is typed (the ``serve`` page's list), without refusing
    others: the spec checks the value, as for a word on the command line (the GPU catalogue,
    whose refusal names every GPU; the precision names, whose old spellings are refused with
    the new name; the optimizer names, beside which an import path is taken)."""


def cli(section: Section, **options: Any) -> dict[str, Cli]:
    """``field(metadata=...)`` of a field on the command line (:class:`Cli`'s fields)."""
    return {METADATA_KEY: Cli(section=section, **options)}


def option_flag(name: str) -> str:
    """The command-line option of a field: ``--batch-size`` for ``batch_size``."""
    return "--" + name.replace("_", "-")


def cli_of(f: Field) -> Cli | None:
    """The command-line form of a dataclass field, None for a field the CLI does not take."""
    return f.metadata.get(METADATA_KEY)


@functools.cache
def field_docs(cls: type) -> Mapping[str, str]:
    """The docstring under each field of the dataclass ``cls`` (the string literal after its
    annotated assignment), read from its source as tools that document dataclasses do."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = inspect.cleandoc(after.value.value)
    return out


def bool_or_int(text: str) -> bool | int:
    """``true``, ``false`` or an integer (FSDP2's ``reshard_after_forward``)."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(lowered)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false or an integer") from None


def json_object(text: str | None, option: str) -> dict[str, Any]:
    """A JSON object written as text; none given is an empty one."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{option} is not valid JSON: {exc.msg} at column {exc.colno}",
            hint="write it like '{\"momentum\": 0.9}'",
        ) from exc
    if not isinstance(value, dict):
        raise InputError(
            f"{option} must be a JSON object, not {type(value).__name__}",
            hint="write it like '{\"momentum\": 0.9}'",
        )
    return value


def comma_names(items: Iterable[str] | None, option: str) -> tuple[str, ...]:
    """Names given one per option or separated by commas, blanks dropped."""
    return tuple(part.strip() for item in items or () for part in item.split(",") if part.strip())
