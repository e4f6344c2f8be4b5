"""The command line's parser: a subcommand per question, each taking the spec options made from
the TrainingSpec fields (options.py) and its own options, written here."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

from vramledger.cli.commands import (
    cmd_advise,
    cmd_cache,
    cmd_compare,
    cmd_compat,
    cmd_estimate,
    cmd_fit,
    cmd_measure,
    cmd_plan,
    cmd_rehearse,
    cmd_run,
    cmd_serve,
)
from vramledger.cli.options import (
    GPU_OPTIONS,
    PARALLEL_OPTIONS,
    STEP_FIXED_OPTIONS,
    add_spec_options,
)
from vramledger.inputs.precision import PRECISIONS
from vramledger.inputs.program import ProgramSpec
from vramledger.inputs.spec import TARGETS
from vramledger.inputs.spec_fields import field_docs, option_flag
from vramledger.inputs.version import __version__
from vramledger.plan.fit import MAXIMIZE, SEQ_STEP


def _add_output_options(
    parser: argparse.ArgumentParser,
    *,
    html: bool = True,
    snapshot: str | None = None,
    plot: str | None = None,
) -> None:
    """--json, --html, --debug, --no-cache; ``snapshot``: what --memory-snapshot writes (the
    predicted "step" or "run"), ``plot``: what --plot draws; None for no such option."""
    if plot is not None:
        parser.add_argument("--plot", metavar="FILE.png", help=f"write {plot}")
    if snapshot is not None:
        parser.add_argument(
            "--memory-snapshot",
            metavar="FILE.pickle",
            help=f"also write the predicted {snapshot} as a PyTorch CUDA memory snapshot "
            "(open it at pytorch.org/memory_viz)",
        )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    if html:
        parser.add_argument(
            "--html",
            metavar="FILE.html",
            help="also write a self-contained HTML report (charts, breakdown, notes)",
        )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="trace again: neither read nor write the cache of traces and answers "
        "(`vramledger cache info`)",
    )


def _add_gpu_options(parser: argparse.ArgumentParser) -> None:
    """plan's and advise's own options beside the spec's --gpu, --gpu-memory and --margin."""
    parser.add_argument(
        "--host-memory",
        metavar="SIZE",
        help="host memory of one node (e.g. 512GiB): answers that offload more do not fit",
    )
    parser.add_argument(
        "--margin-from",
        metavar="REHEARSAL.json",
        help="add the residual a rehearsal measured (`rehearse --json` output) to the margin",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vramledger",
        description="Will this training step fit, where does the memory go, and what would make it fit.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"vramledger {__version__}")
    # no abbreviations: `--gpu` must never be read as `--gpus-per-node`, nor `--gpus 8` as it
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False),
    )
    for add in (
        _add_estimate,
        _add_measure,
        _add_compare,
        _add_run,
        _add_plan,
        _add_advise,
        _add_fit,
        _add_rehearse,
        _add_serve,
        _add_cache,
        _add_compat,
    ):
        add(sub)
    return parser


COMMANDS: dict[str, dict[str, str]] = {
    "estimate": {
        "help": "predict the peak memory of a training step (fake tensors, no GPU)",
    },
    "measure": {
        "help": "run the training step for real and measure it",
    },
    "compare": {
        "help": "train with several optimizers and compare loss curves and memory",
    },
    "run": {
        "help": "predict the memory of your own training program, run unchanged with CUDA "
        "emulated on fake tensors (no GPU)",
        "usage": "vramledger run [OPTIONS] -- PROGRAM.py|-m MODULE|COMMAND [ARGS...]",
    },
    "plan": {
        "help": "the fewest GPUs of a kind per optimizer, and the configurations that fit",
    },
    "advise": {
        "help": "what to change first when a training step does not fit a GPU",
    },
    "fit": {
        "help": "the largest micro-batch and/or sequence length that fits a GPU",
    },
    "rehearse": {
        "help": "run shallow (with --widths also narrower) copies of the model for real, fit their "
        "growth, extrapolate",
    },
    "serve": {
        "help": "a local web page to ask estimate, fit, plan and advise from (needs the serve extra)",
    },
    "cache": {
        "help": "where the cache of traces and answers is and what it holds; clear it",
    },
    "compat": {
        "help": "check that what vramledger patches in torch and the other libraries is still "
        "there in the installed versions",
    },
}
"""Each subcommand's ``add_parser`` arguments: its one-line help (and usage)."""


def _command(sub: Any, func: Any) -> argparse.ArgumentParser:
    """The subcommand of ``func`` (``cmd_NAME``), whose parsed arguments go to it."""
    name = func.__name__.removeprefix("cmd_")
    p = sub.add_parser(name, **COMMANDS[name])
    p.set_defaults(func=func)
    return p


def _add_estimate(sub: Any) -> None:
    p = _command(sub, cmd_estimate)
    add_spec_options(p)
    _add_output_options(p, snapshot="step")


def _add_measure(sub: Any) -> None:
    p = _command(sub, cmd_measure)
    add_spec_options(p, exclude=GPU_OPTIONS)
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)"
    )
    p.add_argument("--compare", action="store_true", help="also estimate, and report the error")
    _add_output_options(p)


def _add_compare(sub: Any) -> None:
    p = _command(sub, cmd_compare)
    add_spec_options(p, exclude=("optimizer", "steps", "target", *GPU_OPTIONS))
    p.add_argument(
        "--optimizers",
        required=True,
        metavar="A,B,...",
        help="optimizers to compare, the first is the reference; NAME@LR sets a learning rate",
    )
    p.add_argument(
        "--steps", dest="steps_to_train", type=int, default=500, help="training steps (default 500)"
    )
    p.add_argument(
        "--data",
        metavar="FILE.py:FUNCTION",
        help="batch of a step: called with step=, device=, batch_size=, seq_len= (default: synthetic)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="largest acceptable final-loss gap (default 0.05)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when present, else cpu")
    _add_output_options(p, html=False, plot="loss curves and memory bars")


def _add_run(sub: Any) -> None:
    p = _command(sub, cmd_run)
    p.add_argument(
        "--target",
        choices=TARGETS,
        default="cuda",
        help="whose decisions the fake tensors follow (default cuda; cpu: predict what a real "
        "CPU run's allocator counts, to check against --measure)",
    )
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="the GPU torch.cuda answers as and the prediction is for (default h100-80gb)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="run the program for real on CPU ('cuda' mapped onto the CPU) and count the CPU "
        "allocator",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=20,
        metavar="N",
        help="stop the program after N optimizer steps in all (default 20)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="stop the program after SECONDS (one that never steps), reporting what was seen",
    )
    p.add_argument(
        "--allow-host-training",
        action="store_true",
        help="exit 0 where the program trained on the CPU and nothing on the GPU (by default "
        "that is a warning and exit status 4: the answer counts none of its training)",
    )
    _add_launch_options(p)
    _add_output_options(p, snapshot="run")
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="PROGRAM [ARGS...]",
        help="a .py script, -m MODULE, or a console script, with its arguments (after --)",
    )


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    """``run``'s torchrun options, each from its ProgramSpec field: the field's docstring is
    the help, its default the default."""
    docs = field_docs(ProgramSpec)
    defaults = {f.name: f.default for f in dataclasses.fields(ProgramSpec)}
    for name in ("nproc_per_node", "nnodes"):
        text = " ".join(docs[name].replace("``", "").split())
        parser.add_argument(
            option_flag(name),
            dest=name,
            type=int,
            default=defaults[name],
            metavar="N",
            help=f"{text} Default: {defaults[name]}.".replace("%", "%%"),
        )


def _add_plan(sub: Any) -> None:
    p = _command(sub, cmd_plan)
    add_spec_options(
        p,
        exclude=("optimizer", "precision", *STEP_FIXED_OPTIONS, *PARALLEL_OPTIONS),
    )
    _add_gpu_options(p)
    p.add_argument(
        "--optimizers",
        default="adamw,adamw8bit,sgd-momentum",
        metavar="A,B,...",
        help="optimizers to plan for (default adamw,adamw8bit,sgd-momentum)",
    )
    p.add_argument(
        "--precisions",
        default="bf16-master",
        metavar="A,B,...",
        help=f"precision modes to search, of {', '.join(PRECISIONS)} (default bf16-master)",
    )
    p.add_argument(
        "--max-gpus",
        "--gpus",
        dest="max_gpus",
        type=int,
        default=1024,
        help="the most GPUs to use (default 1024)",
    )
    p.add_argument(
        "--tp-degrees",
        default="auto",
        metavar="A,B,...|auto|none",
        help="tensor-parallel degrees to lay each answer out with (default auto: 2,4,8 when an "
        "answer spans more than one node)",
    )
    p.add_argument(
        "--pp-degrees",
        default="none",
        metavar="A,B,...|none",
        help="pipeline stages to lay each answer out with, across nodes (default none: a "
        "pipeline estimate traces every layer, about a minute for a 70B model at pp 4)",
    )
    p.add_argument("--no-offload", action="store_true", help="do not consider CPU offload")
    p.add_argument(
        "--gpus-per-node",
        dest="plan_gpus_per_node",
        type=int,
        default=8,
        metavar="N",
        help="GPUs sharing one node's host memory when offloading (default 8)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip re-estimating the answers with the real engines (faster, approximate)",
    )
    _add_workers(p, "for traces and re-estimates", ", or when the first trace takes over a second")
    _add_output_options(p)


def _add_advise(sub: Any) -> None:
    p = _command(sub, cmd_advise)
    add_spec_options(p)
    _add_gpu_options(p)
    _add_output_options(p)


def _add_fit(sub: Any) -> None:
    p = _command(sub, cmd_fit)
    add_spec_options(p, exclude=STEP_FIXED_OPTIONS)
    p.add_argument(
        "--max",
        dest="maximize",
        choices=MAXIMIZE,
        default="batch-size",
        help="what to maximise: batch-size (default), seq-len, or both (the longest sequence "
        "at each power-of-two micro-batch)",
    )
    p.add_argument(
        "--optimizers",
        metavar="A,B,...",
        help="optimizers to answer for (default: --optimizer)",
    )
    p.add_argument(
        "--seq-step",
        type=int,
        default=SEQ_STEP,
        metavar="N",
        help=f"sequence lengths in multiples of N tokens (default {SEQ_STEP})",
    )
    p.add_argument(
        "--checkpointing",
        choices=("both", "on", "off"),
        default="both",
        help="answer with activation checkpointing on, off or both (default both)",
    )
    _add_workers(p, "making estimates, this one included")
    _add_output_options(p)


def _add_workers(p: Any, what: str, otherwise: str = "") -> None:
    """``--workers N`` of ``plan`` and ``fit``: ``what`` the processes do, and when else they
    start by default."""
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help=f"processes {what} (default: one per CPU for models of 1B parameters or "
        f"more{otherwise}; else 1)",
    )


def _add_rehearse(sub: Any) -> None:
    p = _command(sub, cmd_rehearse)
    add_spec_options(
        p,
        exclude=("target", *PARALLEL_OPTIONS, *GPU_OPTIONS),
    )
    p.add_argument(
        "--depths",
        default="1,2,3",
        metavar="N,N,...",
        help="layers of each rehearsal (default 1,2,3)",
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)"
    )
    p.add_argument(
        "--widths",
        metavar="F,G,H",
        help="also rehearse narrower copies, at these fractions of the width (at least three, "
        "dividing every head count; e.g. 0.25,0.5,0.75): every depth at every width",
    )
    _add_output_options(p, html=False, plot="measured points and fitted lines")


def _add_serve(sub: Any) -> None:
    p = _command(sub, cmd_serve)
    p.add_argument(
        "dir",
        nargs="?",
        metavar="DIR",
        help="the folder whose configs (.json files, folders with a config.json) the page may "
        "read; nothing outside it is read (default: none, pasted configs only)",
    )
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free one)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    p.add_argument(
        "--allow-code",
        metavar="DIR",
        help="also build models from FILE.py:FUNCTION under DIR (runs that Python code)",
    )
    p.add_argument("--debug", action="store_true", help="show the server's and workers' logs")


def _add_cache(sub: Any) -> None:
    p = _command(sub, cmd_cache)
    p.add_argument(
        "action",
        choices=("info", "clear"),
        help="info (default) or clear",
        nargs="?",
        default="info",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")


def _add_compat(sub: Any) -> None:
    p = _command(sub, cmd_compat)
    p.add_argument(
        "--all",
        dest="every",
        action="store_true",
        help="list every patch (default: the packages, and the patches not present)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
