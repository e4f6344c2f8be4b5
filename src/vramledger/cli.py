"""The ``vramledger`` command line. Each option sets the TrainingSpec field of the same name;
the library computes, and ``render/`` draws."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console

from . import cache
from .adapters import QUANTIZE
from .attention import IMPLEMENTATIONS
from .chatter import quiet_import_chatter
from .errors import InputError, VramledgerError
from .plan.fit import MAXIMIZE, SEQ_STEP
from .precision import PRECISIONS, canonical_precision
from .spec import OFFLOADS, PP_SCHEDULES, ROUTINGS, STRATEGIES, TARGETS, TrainingSpec
from .tasks import TASKS
from .units import format_bytes
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
        "metavar": "{" + ",".join(PRECISIONS) + "}",
        "default": "fp32",
        "help": "precision mode, Lightning's names (default fp32; bf16-mixed: autocast over fp32 "
        "weights; bf16-master: bf16 weights with an fp32 master copy, as DeepSpeed)",
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
        "choices": STRATEGIES[1:],
        "help": "how the ranks share the work (default ddp on several ranks)",
    },
    "offload": {
        "choices": OFFLOADS,
        "default": "none",
        "help": "what to keep in host memory (default none)",
    },
    "nodes": {"type": int, "help": "machines (with --gpus-per-node, sets the world size)"},
    "gpus_per_node": {"type": int, "help": "GPUs per machine"},
    "deepspeed": {
        "metavar": "ds_config.json",
        "help": "read ZeRO stage, offload, precision and batch from a DeepSpeed config",
    },
    "shard_modules": {
        "metavar": "CLASSNAME",
        "action": "append",
        "default": [],
        "help": "FSDP unit: fully_shard every submodule of this class (repeatable; default: "
        "each block of the model's block stack)",
    },
    "shard_min_params": {
        "type": int,
        "metavar": "N",
        "help": "FSDP units by size: every submodule with more than N parameters",
    },
    "reshard_after_forward": {
        "type": lambda text: _reshard_after_forward(text),
        "metavar": "true|false|N",
        "help": "FSDP2 reshard_after_forward for each unit (default FSDP2's: true)",
    },
    "accelerate_config": {
        "metavar": "FILE.yaml",
        "help": "read FSDP2 wrap policy, offload, resharding, checkpointing, precision and "
        "processes from an accelerate config",
    },
    "dp_shard": {
        "type": int,
        "metavar": "N",
        "help": "ranks the data-parallel axis shards over with FSDP2 (default: world-size / "
        "(tp x pp x cp))",
    },
    "tp": {"type": int, "default": 1, "metavar": "N", "help": "tensor-parallel degree (default 1)"},
    "pp": {"type": int, "default": 1, "metavar": "N", "help": "pipeline stages (default 1)"},
    "pp_schedule": {
        "choices": PP_SCHEDULES,
        "default": "1f1b",
        "help": "pipeline schedule (default 1f1b)",
    },
    "microbatches": {
        "type": int,
        "metavar": "N",
        "help": "micro-batches per pipeline step (default: pp)",
    },
    "cp": {
        "type": int,
        "default": 1,
        "metavar": "N",
        "help": "context-parallel degree (default 1)",
    },
    "ep": {
        "type": int,
        "default": 1,
        "metavar": "N",
        "help": "expert-parallel degree for MoE layers, from the data/context-parallel ranks",
    },
    "tp_plan": {
        "metavar": "FILE.py:FUNCTION",
        "help": "the model's tensor-parallel plan (default: its family's)",
    },
    "moe_routing": {
        "choices": ROUTINGS,
        "default": "balanced",
        "help": "how MoE routers' choices are answered in a trace when the memory depends on it: "
        "balanced (default), first, last, or worst (the largest)",
    },
    "lora": {
        "metavar": "r=R,alpha=A,targets=M1,M2[,dropout=P]",
        "help": "LoRA adapters through peft (targets=all-linear for every linear layer); the base "
        "is frozen",
    },
    "attn_implementation": {
        "choices": IMPLEMENTATIONS,
        "help": "attention path of a Hugging Face model: sdpa (transformers' default), eager, "
        "or flash_attention_2 (the flash-attn package, modelled from its code)",
    },
    "quantize": {
        "choices": QUANTIZE,
        "help": "bitsandbytes base weights: nf4/fp4 (QLoRA, double quantization) or int8",
    },
    "freeze": {
        "metavar": "PATTERN",
        "action": "append",
        "default": [],
        "help": "freeze parameters whose names match this fnmatch pattern (repeatable)",
    },
    "gpu": {
        "metavar": "NAME",
        "help": "GPU from the catalogue (a100-80gb, h100-80gb, v100-32gb, ...): CUDA's decisions "
        "for its compute capability, and whether the step fits (default: compute capability 9.0, "
        "no verdict)",
    },
    "gpu_memory": {
        "metavar": "SIZE",
        "help": "memory of a GPU not in the catalogue (e.g. 24GiB; with --gpu, that GPU's kind)",
    },
    "margin": {
        "metavar": "SIZE",
        "help": "memory kept back for the CUDA context, NCCL and fragmentation (default 2GiB)",
    },
}


PARALLEL_OPTIONS = (
    "world_size",
    "dp_shard",
    "tp",
    "pp",
    "pp_schedule",
    "microbatches",
    "cp",
    "ep",
    "tp_plan",
    "strategy",
    "offload",
    "nodes",
    "gpus_per_node",
    "deepspeed",
    "shard_modules",
    "shard_min_params",
    "reshard_after_forward",
    "accelerate_config",
)
"""Spec options that ``plan`` searches itself and ``rehearse`` (one device) does not take."""
GPU_OPTIONS = ("gpu", "gpu_memory", "margin")
"""Spec options of the GPU predicted for, which commands that run on a real device do not take."""


def _add_spec_options(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    parser.add_argument(
        "model", help="config.json (or its folder), FILE.py:FUNCTION or package.module:FUNCTION"
    )
    for name, kwargs in SPEC_OPTIONS.items():
        if name not in exclude:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)


def _add_output_options(parser: argparse.ArgumentParser, *, html: bool = True) -> None:
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


def spec_from_args(args: argparse.Namespace) -> TrainingSpec:
    values = {name: getattr(args, name, None) for name in SPEC_OPTIONS}
    values["optimizer_kwargs"] = parse_json_object(values["optimizer_kwargs"], "--optimizer-kwargs")
    values["freeze"] = tuple(values["freeze"] or ())
    for name in ("checkpoint_modules", "shard_modules"):
        values[name] = tuple(
            part.strip() for item in values[name] or () for part in item.split(",") if part.strip()
        )
    values = {k: v for k, v in values.items() if v is not None}
    return TrainingSpec(model=args.model, **values)


def _reshard_after_forward(text: str) -> bool | int:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(lowered)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false or an integer") from None


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
def _with_progress(args: argparse.Namespace, run: Callable[[Any], Any]) -> Any:
    """``run(progress)`` with a progress bar on stderr, or quietly for ``--json``."""
    if args.json:
        return run(None)
    bar, progress = _progress_bar()
    with bar:
        return run(progress)


def _report(
    args: argparse.Namespace,
    result: Any,
    table: Callable[[Any], Any],
    plot: Callable[[Any, str], Any] | None = None,
) -> int:
    """Write the plot, HTML report and memory snapshot if asked, then print JSON or the
    terminal table."""
    plotted = plot is not None and getattr(args, "plot", None)
    if plotted:
        plot(result, args.plot)
    if getattr(args, "html", None):
        from .render.html import write_html

        write_html(result, args.html)
    if getattr(args, "memory_snapshot", None):
        from .render.snapshot import write_memory_snapshot

        write_memory_snapshot(result, args.memory_snapshot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from .render.terminal import print_renderable

        print_renderable(table(result))
        if plotted:
            print(f"plot: {args.plot}")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from .predict import estimate
    from .render.terminal import ledger_table

    return _report(args, estimate(spec_from_args(args)), ledger_table)


def cmd_measure(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .measure import measure
    from .parallel.real import torchrun_group
    from .render.terminal import measurement_table

    with torchrun_group(args.device) as world:
        if world is not None and args.world_size == 1:
            args.world_size = world  # under torchrun the launch says how many ranks
        result = measure(spec_from_args(args), device=args.device, compare=args.compare)
        if world is not None and dist.get_rank() != 0:
            return 0  # rank 0 reports every rank
    return _report(args, result, measurement_table)


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import compare
    from .render.plots import comparison_plot
    from .render.terminal import comparison_table

    optimizers = _names(args.optimizers, "--optimizers")
    spec = spec_from_args(args)
    result = _with_progress(
        args,
        lambda progress: compare(
            spec,
            optimizers,
            steps=args.steps_to_train,
            data=args.data,
            tolerance=args.tolerance,
            device=args.device,
            progress=progress,
        ),
    )
    return _report(args, result, comparison_table, comparison_plot)


def cmd_run(args: argparse.Namespace) -> int:
    """Run the user's program with CUDA emulated (or for real on CPU with --measure) and report
    its memory; the program's own exception is shown as the program's."""
    import contextlib

    from .program import ProgramFailed, ProgramSpec

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    module = bool(command) and command[0] == "-m"
    if module:
        command = command[1:]
    if not command:
        raise InputError(
            "no program to run", hint="write `vramledger run [OPTIONS] -- train.py [ARGS...]`"
        )
    spec = ProgramSpec(
        program=command[0],
        args=tuple(command[1:]),
        module=module,
        max_steps=args.max_steps,
        timeout=args.timeout,
    )
    # with --json the program's own output goes to stderr, so stdout is the JSON alone
    output = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with output:
            if args.measure:
                from .measure_program import measure_program

                result = measure_program(spec, gpu=args.gpu)
            else:
                from .predict_program import run_program

                result = run_program(spec, target=args.target, gpu=args.gpu)
    except ProgramFailed as failed:
        sys.stdout.flush()
        print(
            "vramledger: the program raised; its traceback (the error is the program's, not "
            "vramledger's):",
            file=sys.stderr,
        )
        print(failed.program_traceback.rstrip(), file=sys.stderr)
        print(f"vramledger: error: {failed.one_line()}", file=sys.stderr)
        return 1
    return _report_program(args, result)


def _report_program(args: argparse.Namespace, result: Any) -> int:
    """Write the HTML report and memory snapshot of the program's ledger if asked, then print
    JSON or the tables; the exit status says how the program ended."""
    from .render.program import measured_program_table, program_table
    from .render.terminal import print_renderable

    ledger = getattr(result, "ledger", None)
    for option in ("html", "memory_snapshot"):
        if getattr(args, option, None) and ledger is None:
            raise InputError(
                f"--{option.replace('_', '-')} needs a prediction with two optimizer steps or more",
                hint="let the program step (--max-steps, --timeout), without --measure",
            )
    if args.html:
        from pathlib import Path

        from .render.html import ledger_html

        try:
            Path(args.html).write_text(
                ledger_html(ledger, title=f"vramledger run: {result.program}"), encoding="utf-8"
            )
        except OSError as exc:
            raise InputError(
                f"cannot write {args.html}: {exc.strerror}", hint="check the path"
            ) from exc
    if args.memory_snapshot:
        from .render.snapshot import write_memory_snapshot

        write_memory_snapshot(ledger, args.memory_snapshot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        table = measured_program_table if args.measure else program_table
        print_renderable(table(result))
    if result.ending == "timeout":
        print(
            f"vramledger: the program was stopped by --timeout {args.timeout:g} after "
            f"{result.steps} optimizer step{'s' if result.steps != 1 else ''}",
            file=sys.stderr,
        )
        return 3
    return result.exit_code


def _progress_bar() -> Any:
    """A rich progress bar and a ``progress(name, done, total)`` callback that drives it."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
        console=Console(stderr=True),
    )
    tasks: dict[str, Any] = {}

    def progress(name: str, done: int, total: int) -> None:
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=total)
        bar.update(tasks[name], completed=done, total=total)

    return bar, progress


def _names(text: str, option: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise InputError(f"{option} is empty", hint=f"write it like {option} adamw,sgd-momentum")
    return names


def _gpu(args: argparse.Namespace) -> Any:
    from .gpus import resolve_gpu

    return resolve_gpu(args.gpu, args.gpu_memory)


def _margin(args: argparse.Namespace) -> tuple[int, str]:
    """The explicit margin, plus a rehearsal's residual when --margin-from gives one."""
    from .units import format_bytes, parse_bytes
    from .verdict import DEFAULT_MARGIN, MARGIN_SOURCE

    if args.margin is None:
        margin, source = DEFAULT_MARGIN, MARGIN_SOURCE
    else:
        margin = parse_bytes(args.margin, allow_zero=True, option="--margin")
        source = "given with --margin"
    if getattr(args, "margin_from", None):
        residual = read_rehearsal_residual(args.margin_from)
        margin += residual
        source += f"; plus {format_bytes(residual)} residual beyond tensors from {args.margin_from}"
    return margin, source


def read_rehearsal_residual(path: str) -> int:

    from .jsonfile import read_json_object

    hint = "write it with `vramledger rehearse ... --json > FILE`"
    data = read_json_object(path, "rehearsal file", hint=hint)
    residual = data.get("residual_bytes")
    if not isinstance(residual, int) or residual < 0:
        raise InputError(
            f"{path} has no residual_bytes (a non-negative integer)",
            hint=hint,
        )
    return residual


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan.search import plan
    from .render.planning import plan_table

    gpu = _gpu(args)
    margin, source = _margin(args)
    spec = spec_from_args(args)
    precisions = [canonical_precision(name) for name in _names(args.precisions, "--precisions")]
    result = _with_progress(
        args,
        lambda progress: plan(
            spec,
            gpu,
            optimizers=_names(args.optimizers, "--optimizers"),
            max_gpus=args.max_gpus,
            margin=margin,
            margin_source=source,
            precisions=precisions,
            offloads=("none",) if args.no_offload else ("none", "optimizer"),
            verify=not args.no_verify,
            workers=args.workers,
            host_memory=_host_memory(args),
            gpus_per_node=args.plan_gpus_per_node,
            progress=progress,
            tp_degrees=_degrees(args.tp_degrees, "--tp-degrees", auto=True),
            pp_degrees=_degrees(args.pp_degrees, "--pp-degrees") or (),
        ),
    )
    return _report(args, result, plan_table)


def _degrees(text: str, option: str, auto: bool = False) -> list[int] | None:
    """``auto`` (None: the planner decides), ``none`` (empty) or a list of degrees >= 1."""
    if auto and text == "auto":
        return None
    if text == "none":
        return []
    out = []
    for part in _names(text, option):
        if not part.isdigit() or int(part) < 1:
            raise InputError(
                f"{option} takes positive integers, not {part!r}",
                hint=f"e.g. {option} 2,4,8" + (", auto" if auto else "") + " or none",
            )
        out.append(int(part))
    return out


def _host_memory(args: argparse.Namespace) -> int | None:
    from .units import parse_bytes

    return parse_bytes(args.host_memory, option="--host-memory") if args.host_memory else None


def cmd_advise(args: argparse.Namespace) -> int:
    from .plan.advise import DEFAULT_GPUS_PER_NODE, advise
    from .render.planning import advice_table

    gpu = _gpu(args)
    margin, _ = _margin(args)
    advice = advise(
        spec_from_args(args),
        gpu,
        margin=margin,
        host_memory=_host_memory(args),
        gpus_per_node=args.gpus_per_node or DEFAULT_GPUS_PER_NODE,
    )
    return _report(args, advice, advice_table)


def cmd_fit(args: argparse.Namespace) -> int:
    from .plan.fit import fit
    from .render.planning import fit_table

    spec = spec_from_args(args)
    gpu = spec.gpu_kind()
    if gpu is None:
        raise InputError("fit needs a GPU", hint="pass --gpu NAME or --gpu-memory SIZE")
    checkpointing = {"both": (False, True), "on": (True,), "off": (False,)}[args.checkpointing]
    optimizers = _names(args.optimizers, "--optimizers") if args.optimizers else None
    result = fit(
        spec,
        gpu,
        maximize=args.maximize,
        optimizers=optimizers,
        checkpointing=checkpointing,
        margin=spec.margin_bytes,
        seq_step=args.seq_step,
    )
    return _report(args, result, fit_table)


def cmd_cache(args: argparse.Namespace) -> int:
    if args.action == "clear":
        deleted = cache.clear()
        print(f"cache: {deleted} entries deleted from {cache.cache_dir()}")
        return 0
    about = cache.info()
    if args.json:
        print(json.dumps(about, indent=2))
        return 0
    state = "on" if about["enabled"] else f"off ({cache.NO_CACHE_VARIABLE}=1)"
    print(
        f"cache: {about['path']} ({state}; {format_bytes(about['bytes'])} of at most "
        f"{format_bytes(about['max_bytes'])}, least recently used entries deleted beyond)"
    )
    for kind, held in about["kinds"].items():
        print(
            f"  {kind}: {held['entries']} entries, {format_bytes(held['bytes'])} "
            f"({held['entries_this_version']} made by this version)"
        )
    return 0


def cmd_rehearse(args: argparse.Namespace) -> int:
    from .plan.rehearse import rehearse
    from .render.planning import rehearsal_table
    from .render.plots import rehearsal_plot

    try:
        depths = [int(d) for d in _names(args.depths, "--depths")]
    except ValueError as exc:
        raise InputError(
            f"--depths must be integers, not {args.depths!r}", hint="--depths 1,2,3"
        ) from exc
    widths = None
    if args.widths:
        try:
            widths = [float(w) for w in _names(args.widths, "--widths")]
        except ValueError as exc:
            raise InputError(
                f"--widths must be fractions of the model's width, not {args.widths!r}",
                hint="--widths 0.25,0.5,0.75",
            ) from exc
    spec = spec_from_args(args)
    result = _with_progress(
        args,
        lambda progress: rehearse(
            spec, depths=depths, widths=widths, device=args.device, progress=progress
        ),
    )
    return _report(args, result, rehearsal_table, rehearsal_plot)


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .serve.app import serve

    return serve(
        Path(args.dir) if args.dir else None,
        host=args.host,
        port=args.port,
        code=Path(args.allow_code) if args.allow_code else None,
        debug=args.debug,
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

    p = sub.add_parser(
        "estimate", help="predict the peak memory of a training step (fake tensors, no GPU)"
    )
    _add_spec_options(p)
    p.add_argument(
        "--memory-snapshot",
        metavar="FILE.pickle",
        help="also write the predicted step as a PyTorch CUDA memory snapshot "
        "(open it at pytorch.org/memory_viz)",
    )
    _add_output_options(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("measure", help="run the training step for real and measure it")
    _add_spec_options(p, exclude=GPU_OPTIONS)
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)"
    )
    p.add_argument("--compare", action="store_true", help="also estimate, and report the error")
    _add_output_options(p)
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser(
        "compare", help="train with several optimizers and compare loss curves and memory"
    )
    _add_spec_options(p, exclude=("optimizer", "steps", "target", *GPU_OPTIONS))
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
    _add_output_options(p, html=False)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "run",
        help="predict the memory of your own training program, run unchanged with CUDA "
        "emulated on fake tensors (no GPU)",
        usage="vramledger run [OPTIONS] -- PROGRAM.py|-m MODULE|COMMAND [ARGS...]",
    )
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="the GPU torch.cuda answers as and the prediction is for (default h100-80gb)",
    )
    p.add_argument(
        "--target",
        choices=("cuda", "cpu"),
        default="cuda",
        help="whose decisions the fake tensors follow (default cuda; cpu: predict what a real "
        "CPU run's allocator counts, to check against --measure)",
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
        "--memory-snapshot",
        metavar="FILE.pickle",
        help="also write the predicted run as a PyTorch CUDA memory snapshot",
    )
    _add_output_options(p)
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="PROGRAM [ARGS...]",
        help="a .py script, -m MODULE, or a console script, with its arguments (after --)",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "plan", help="the fewest GPUs of a kind per optimizer, and the configurations that fit"
    )
    _add_spec_options(
        p,
        exclude=("optimizer", "precision", "target", "steps", *PARALLEL_OPTIONS),
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
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="processes for traces and re-estimates (default: one per CPU for models of 1B "
        "parameters or more, or when the first trace takes over a second; else 1)",
    )
    _add_output_options(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "advise", help="what to change first when a training step does not fit a GPU"
    )
    _add_spec_options(p)
    _add_gpu_options(p)
    _add_output_options(p)
    p.set_defaults(func=cmd_advise)

    p = sub.add_parser("fit", help="the largest micro-batch and/or sequence length that fits a GPU")
    _add_spec_options(p, exclude=("target", "steps"))
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
    _add_output_options(p)
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser(
        "rehearse",
        help="run shallow (with --widths also narrower) copies of the model for real, fit their "
        "growth, extrapolate",
    )
    _add_spec_options(
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
    p.add_argument("--plot", metavar="FILE.png", help="write measured points and fitted lines")
    _add_output_options(p, html=False)
    p.set_defaults(func=cmd_rehearse)

    p = sub.add_parser(
        "serve",
        help="a local web page to ask estimate, fit, plan and advise from (needs the serve extra)",
    )
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
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "cache", help="where the cache of traces and answers is and what it holds; clear it"
    )
    p.add_argument(
        "action",
        choices=("info", "clear"),
        help="info (default) or clear",
        nargs="?",
        default="info",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    p.set_defaults(func=cmd_cache)
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
    quiet_import_chatter()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    if getattr(args, "no_cache", False):  # the planner's workers inherit it
        os.environ[cache.NO_CACHE_VARIABLE] = "1"
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
