"""The ``vramledger`` command line. Each option sets the TrainingSpec field of the same name;
the library computes, and ``render/`` draws."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .errors import InputError, VramledgerError
from .precision import PRECISIONS
from .sources import TASKS
from .spec import TARGETS, TrainingSpec
from .version import __version__

# Options that set TrainingSpec fields, shared by every command that runs a training step.
SPEC_OPTIONS: dict[str, dict[str, Any]] = {
    "task": {
        "choices": TASKS,
        "help": "Hugging Face task (default: from the config's architectures)",
    },
    "batch_size": {"type": int, "default": 1, "help": "micro-batch size (default 1)"},
    "seq_len": {"type": int, "default": 512, "help": "tokens per example (default 512)"},
    "image_size": {"type": int, "help": "image side in pixels (default: the config's)"},
    "inputs": {
        "metavar": "FILE.py:FUNCTION",
        "help": "function making a batch (device=, batch_size=, seq_len=)",
    },
    "loss": {
        "metavar": "FILE.py:FUNCTION",
        "help": "loss(model, batch) -> scalar (default: output.loss)",
    },
    "optimizer": {
        "default": "adamw",
        "help": "torch.optim name (adamw, sgd, sgd-momentum, ...) or import path",
    },
    "optimizer_kwargs": {"metavar": "JSON", "help": "optimizer keyword arguments as a JSON object"},
    "precision": {
        "choices": tuple(PRECISIONS),
        "default": "fp32",
        "help": "precision mode (default fp32)",
    },
    "grad_checkpointing": {
        "action": "store_true",
        "help": "activation checkpointing (Hugging Face switch)",
    },
    "checkpoint_modules": {
        "metavar": "CLASSNAME",
        "action": "append",
        "default": [],
        "help": "checkpoint every submodule of this class (repeatable)",
    },
    "grad_accum": {"type": int, "default": 1, "help": "micro-steps per optimizer step (default 1)"},
    "steps": {"type": int, "default": 2, "help": "steps to run, >= 2 (default 2)"},
    "target": {"choices": TARGETS, "default": "cuda", "help": "device to predict (default cuda)"},
    "seed": {"type": int, "default": 0, "help": "seed for real runs (default 0)"},
    "world_size": {"type": int, "default": 1, "help": "data-parallel ranks (default 1)"},
    "strategy": {
        "choices": ("ddp", "zero1", "zero2", "zero3", "fsdp"),
        "help": "how the ranks share the work (default ddp on several ranks)",
    },
    "offload": {
        "choices": ("none", "optimizer", "params", "both"),
        "default": "none",
        "help": "what to keep in host memory (default none)",
    },
    "nodes": {"type": int, "help": "machines (with --gpus-per-node, sets the world size)"},
    "gpus_per_node": {"type": int, "help": "GPUs per machine"},
    "deepspeed": {
        "metavar": "ds_config.json",
        "help": "read ZeRO stage, offload, precision and batch from a DeepSpeed config",
    },
}


def _add_spec_options(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    parser.add_argument(
        "model", help="config.json (or its folder), FILE.py:FUNCTION or package.module:FUNCTION"
    )
    for name, kwargs in SPEC_OPTIONS.items():
        if name not in exclude:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")


def spec_from_args(args: argparse.Namespace) -> TrainingSpec:
    values = {name: getattr(args, name, None) for name in SPEC_OPTIONS}
    values["optimizer_kwargs"] = parse_json_object(values["optimizer_kwargs"], "--optimizer-kwargs")
    values["checkpoint_modules"] = tuple(
        part.strip()
        for item in values["checkpoint_modules"] or ()
        for part in item.split(",")
        if part.strip()
    )
    values = {k: v for k, v in values.items() if v is not None}
    return TrainingSpec(model=args.model, **values)


def parse_json_object(text: str | None, option: str) -> dict[str, Any]:
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


# -- commands ---------------------------------------------------------------------------------
def cmd_estimate(args: argparse.Namespace) -> int:
    from .predict import estimate

    ledger = estimate(spec_from_args(args))
    if args.json:
        print(json.dumps(ledger.to_dict(), indent=2))
    else:
        from .render.terminal import ledger_table, print_renderable

        print_renderable(ledger_table(ledger))
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    from .measure import measure

    result = measure(spec_from_args(args), device=args.device, compare=args.compare)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from .render.terminal import measurement_table, print_renderable

        print_renderable(measurement_table(result))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import compare

    optimizers = [o for o in args.optimizers.split(",") if o.strip()]
    spec = spec_from_args(args)
    if args.json:
        result = compare(
            spec,
            optimizers,
            steps=args.steps_to_train,
            data=args.data,
            tolerance=args.tolerance,
            device=args.device,
        )
    else:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, transient=True) as bar:
            tasks: dict[str, int] = {}

            def progress(name: str, step: int, total: int) -> None:
                if name not in tasks:
                    tasks[name] = bar.add_task(name, total=total)
                bar.update(tasks[name], completed=step)

            result = compare(
                spec,
                optimizers,
                steps=args.steps_to_train,
                data=args.data,
                tolerance=args.tolerance,
                device=args.device,
                progress=progress,
            )
    if args.plot:
        from .render.plots import comparison_plot

        comparison_plot(result, args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from .render.terminal import comparison_table, print_renderable

        print_renderable(comparison_table(result))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vramledger",
        description="Will this training step fit, where does the memory go, and what would make it fit.",
    )
    parser.add_argument("--version", action="version", version=f"vramledger {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "estimate", help="predict the peak memory of a training step (fake tensors, no GPU)"
    )
    _add_spec_options(p)
    _add_output_options(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("measure", help="run the training step for real and measure it")
    _add_spec_options(p)
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)"
    )
    p.add_argument("--compare", action="store_true", help="also estimate, and report the error")
    _add_output_options(p)
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser(
        "compare", help="train with several optimizers and compare loss curves and memory"
    )
    _add_spec_options(p, exclude=("optimizer", "steps", "target"))
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
    p.add_argument("--plot", metavar="FILE.png", help="write loss curves and memory bars")
    _add_output_options(p)
    p.set_defaults(func=cmd_compare)
    return parser


def _quiet_libraries(debug: bool) -> None:
    if debug:
        logging.basicConfig(level=logging.INFO)
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    # Optional libraries log their missing GPU kernels at import; none of it concerns a user here.
    for name in (
        "torchao",
        "bitsandbytes",
        "torch._dynamo",
        "torch._inductor",
        "torch.utils._pytree",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    _quiet_libraries(debug)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except VramledgerError as exc:
        if debug:
            raise
        print(f"vramledger: error: {exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vramledger: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"vramledger: error: {type(exc).__name__}: {first} (pass --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
