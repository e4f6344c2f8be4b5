"""The command line's spec options against the TrainingSpec fields they are made from: every
field an option (or named Python-only with a reason), the same defaults, the field's docstring
as the help, the spec's own choices; and the entry points that run the command line."""

import argparse
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from vramledger.cli import build_parser, spec_from_args
from vramledger.cli.options import GPU_OPTIONS, PARALLEL_OPTIONS, PYTHON_ONLY, flag
from vramledger.cli.serve.worker import LEFT_OUT
from vramledger.inputs.precision import PRECISIONS
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.spec_fields import cli_of, field_docs

FIELDS = {f.name: f for f in fields(TrainingSpec)}
SPEC_COMMANDS = ("estimate", "measure", "compare", "plan", "advise", "fit", "rehearse")
"""The commands that take a TrainingSpec (``run``, ``serve`` and ``cache`` do not)."""
CLI_SOURCES = Path(__file__).resolve().parent.parent / "src" / "vramledger" / "cli"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _spec_actions(command: str) -> dict[str, argparse.Action]:
    """The command's actions that set a TrainingSpec field, by field name."""
    parser = _subparsers()[command]
    return {a.dest: a for a in parser._actions if a.dest in FIELDS}


def _spec_default(name: str):
    f = FIELDS[name]
    return f.default_factory() if f.default is MISSING else f.default


def _as_spec_value(name: str, value):
    """What ``spec_from_args`` makes of a parsed value (the CLI's one conversion)."""
    form = cli_of(FIELDS[name])
    if form.convert is not None:
        return form.convert(value, flag(FIELDS[name]))
    if isinstance(value, list):
        return tuple(value)
    return value


def _help(name: str) -> str:
    """The field's docstring as argparse is given it, with the dataclass default after it."""
    text = " ".join(field_docs(TrainingSpec)[name].replace("``", "").split())
    default = FIELDS[name].default
    if isinstance(default, (str, int)) and not isinstance(default, bool):
        text += f" Default: {default}."
    return text


def test_every_field_is_an_option_or_named_python_only():
    on_cli = set(_spec_actions("estimate"))  # estimate takes the whole spec
    for name, reason in PYTHON_ONLY.items():
        assert name in FIELDS, f"PYTHON_ONLY names {name}, not a TrainingSpec field"
        assert reason.strip(), f"PYTHON_ONLY gives no reason for {name}"
        assert cli_of(FIELDS[name]) is None and name not in on_cli
    missing = set(FIELDS) - on_cli - set(PYTHON_ONLY)
    assert not missing, f"TrainingSpec fields neither on the CLI nor in PYTHON_ONLY: {missing}"


@pytest.mark.parametrize("command", SPEC_COMMANDS)
def test_cli_defaults_are_the_spec_defaults(command):
    actions = _spec_actions(command)
    assert actions, command
    for name, action in actions.items():
        if name == "model":
            assert action.required and not action.option_strings
            continue
        assert _as_spec_value(name, action.default) == _spec_default(name), (
            f"{command} {action.option_strings[0]}: default {action.default!r}, "
            f"the spec's {_spec_default(name)!r}"
        )
    # and the spec the command line builds when no option is given is the Python API's
    required = {"compare": ["--optimizers", "sgd"]}  # compare's own option, not the spec's
    args = build_parser().parse_args([command, "m.json", *required.get(command, [])])
    assert spec_from_args(args) == TrainingSpec(model="m.json")


def test_help_is_the_field_docstring():
    docs = field_docs(TrainingSpec)
    assert set(docs) == set(FIELDS), "every TrainingSpec field has a docstring under it"
    for name, action in _spec_actions("estimate").items():
        assert action.help.replace("%%", "%") == _help(name), name
    # written once: the first sentence of no field's docstring is copied into the CLI's code
    code = "".join(p.read_text() for p in sorted(CLI_SOURCES.glob("*.py")))
    for name, doc in docs.items():
        first = " ".join(doc.split())[:40]
        assert first not in " ".join(code.split()), f"{name}'s docstring copied in cli/"


def test_flags_are_the_field_names():
    for name, action in _spec_actions("estimate").items():
        expected = [] if name == "model" else ["--" + name.replace("_", "-")]
        assert action.option_strings == expected


def test_choices_are_the_specs_and_each_is_taken():
    needs = {"strategy": {"world_size": 2}}  # a strategy shares the work of several ranks
    checked = 0
    for name, action in _spec_actions("estimate").items():
        form = cli_of(FIELDS[name])
        assert action.choices == form.choices, name
        for choice in action.choices or ():
            spec = TrainingSpec(model="m.json", **needs.get(name, {}), **{name: choice})
            assert getattr(spec, name) == choice
            checked += 1
    assert checked > 20
    # precision takes the frameworks' aliases too, so it shows its names without refusing others
    precision = _spec_actions("estimate")["precision"]
    assert precision.choices is None and all(p in precision.metavar for p in PRECISIONS)
    for name in PRECISIONS:
        assert TrainingSpec(model="m.json", precision=name).precision == name


def test_commands_leave_out_what_they_answer_themselves():
    subs = _subparsers()
    plan, rehearse, measure = (set(_spec_actions(c)) for c in ("plan", "rehearse", "measure"))
    assert not plan & set(PARALLEL_OPTIONS)
    # the page's questions leave out what the commands do not take (its plan searches the
    # form's one optimizer and precision, the command's --optimizers and --precisions)
    estimate = set(_spec_actions("estimate"))
    for kind in ("fit", "plan", "advise"):
        own = {"optimizer", "precision"} if kind == "plan" else set()
        assert estimate - set(_spec_actions(kind)) - own == set(LEFT_OUT.get(kind, ())), kind
    assert not rehearse & (set(PARALLEL_OPTIONS) | set(GPU_OPTIONS))
    assert not measure & set(GPU_OPTIONS) and "world_size" in measure
    assert {"world_size", "tp", "pp", "strategy", "gpus_per_node"} <= set(PARALLEL_OPTIONS)
    assert set(GPU_OPTIONS) == {"gpu", "gpu_memory", "margin"}
    # plan's own --gpus-per-node (host memory per node) and compare's --steps are not the spec's
    assert subs["plan"].parse_args(["m.json", "--gpus-per-node", "4"]).plan_gpus_per_node == 4
    args = subs["compare"].parse_args(["m.json", "--optimizers", "sgd", "--steps", "9"])
    assert args.steps_to_train == 9 and spec_from_args(args).steps == 2


def test_options_reach_the_spec():
    args = build_parser().parse_args(
        [
            "estimate",
            "m.json",
            "--batch-size",
            "3",
            "--optimizer-kwargs",
            '{"momentum": 0.9}',
            "--checkpoint-modules",
            "A,B",
            "--checkpoint-modules",
            "C",
            "--freeze",
            "x.*,y",
            "--world-size",
            "2",
            "--strategy",
            "fsdp",
            "--reshard-after-forward",
            "2",
            "--grad-checkpointing",
            "--margin",
            "1GiB",
        ]
    )
    spec = spec_from_args(args)
    assert spec.batch_size == 3 and spec.optimizer_kwargs == {"momentum": 0.9}
    assert spec.checkpoint_modules == ("A", "B", "C") and spec.freeze == ("x.*,y",)
    assert spec.reshard_after_forward == 2 and spec.grad_checkpointing
    assert spec.margin == 1 << 30


@pytest.mark.parametrize("module", ["vramledger.cli", "vramledger"])
def test_entry_points_run_the_command_line(module):
    done = subprocess.run(
        [sys.executable, "-m", module, "estimate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--batch-size" in done.stdout and "Micro-batch size" in done.stdout
