"""The commands: each reads its options, asks the library and hands the answer to report.py."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vramledger.cli.options import spec_from_args
from vramledger.cli.report import PATCH_MISSING_EXIT, report, report_program, with_progress
from vramledger.inputs import cache
from vramledger.inputs.errors import InputError
from vramledger.inputs.precision import canonical_precision
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.units import format_bytes


def checked_spec(
    args: argparse.Namespace, *, optimizers: list[str] | None = None, floor: bool = False
) -> TrainingSpec:
    """The spec the options say, checked before any work: the optional libraries it, the
    command's own options and its ``optimizers`` need are installed (extras.py), and with
    ``floor`` that some GPU could hold the step at all (memory_floor.py)."""
    from vramledger.inputs.extras import check_extras, optimizer_needs, option_needs, spec_needs
    from vramledger.inputs.launch_configs import apply_configs

    spec = spec_from_args(args)
    check_extras(spec_needs(spec) + option_needs(vars(args)) + optimizer_needs(optimizers or []))
    applied, _ = apply_configs(spec)  # a --deepspeed config's stage says DeepSpeed's engine
    check_extras(spec_needs(applied))
    if floor:
        from vramledger.inputs.memory_floor import check_floor

        check_floor(applied)
    return spec


def cmd_estimate(args: argparse.Namespace) -> int:
    from vramledger.predict.step import estimate
    from vramledger.render.terminal import ledger_table, ledger_timing

    return report(
        args, estimate(checked_spec(args, floor=True)), ledger_table, timing=ledger_timing
    )


def cmd_measure(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from vramledger.measure import measure
    from vramledger.parallel.real import torchrun_group
    from vramledger.render.terminal import measurement_table

    with torchrun_group(args.device) as world:
        if world is not None and args.world_size == 1:
            args.world_size = world  # under torchrun the launch says how many ranks
        result = measure(checked_spec(args), device=args.device, compare=args.compare)
        if world is not None and dist.get_rank() != 0:
            return 0  # rank 0 reports every rank
    return report(args, result, measurement_table)


def cmd_compare(args: argparse.Namespace) -> int:
    from vramledger.measure.compare import compare
    from vramledger.render.plots import comparison_plot
    from vramledger.render.terminal import comparison_table

    optimizers = _names(args.optimizers, "--optimizers")
    spec = checked_spec(args, optimizers=optimizers)
    result = with_progress(
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
    return report(args, result, comparison_table, comparison_plot)


def cmd_run(args: argparse.Namespace) -> int:
    """Run the user's program with CUDA emulated (or for real on CPU with --measure) and report
    its memory; the program's own exception is shown as the program's."""
    import contextlib

    from vramledger.inputs.program import ProgramFailed, ProgramSpec, children_note, parse_command
    from vramledger.measure.attribution import TraceFailed

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    program, program_args, module = parse_command(command)
    spec = ProgramSpec(
        program=program,
        args=program_args,
        module=module,
        max_steps=args.max_steps,
        timeout=args.timeout,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
    )
    # with --json the program's own output goes to stderr, so stdout is the JSON alone
    output = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with output:
            if args.measure:
                from vramledger.measure.program import measure_program

                result = measure_program(spec, gpu=args.gpu, quiet=args.json)
            else:
                from vramledger.measure.attribution import run_program_checked

                result = run_program_checked(spec, target=args.target, gpu=args.gpu)
    except ProgramFailed as failed:
        sys.stdout.flush()
        whose = (
            "the error is the program's, not vramledger's"
            if failed.confirmed
            else "whose error it is could not be told: the hint below says why"
        )
        print(f"vramledger: the program raised; its traceback ({whose}):", file=sys.stderr)
        print(failed.program_traceback.rstrip(), file=sys.stderr)
        if failed.children:
            print(f"vramledger: note: {children_note(failed.children)}", file=sys.stderr)
        print(f"vramledger: error: {failed.one_line()}", file=sys.stderr)
        return 1
    except TraceFailed as failed:
        sys.stdout.flush()
        plain = (
            "the program itself ran without error"
            if failed.plain_steps is not None
            else "its plain run failed the same way, in vramledger's own code"
        )
        print(
            "vramledger: its trace of the program failed; the traceback, in the program's "
            f"frames ({plain}):",
            file=sys.stderr,
        )
        print(failed.program_traceback.rstrip(), file=sys.stderr)
        print(f"vramledger: error: {failed.one_line()}", file=sys.stderr)
        return 1
    return report_program(args, result)


def _names(text: str, option: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise InputError(f"{option} is empty", hint=f"write it like {option} adamw,sgd-momentum")
    return names


def _gpu(args: argparse.Namespace) -> Any:
    from vramledger.inputs.gpus import resolve_gpu

    return resolve_gpu(args.gpu, args.gpu_memory)


def _margin(args: argparse.Namespace) -> tuple[int, str]:
    """The explicit margin, plus a rehearsal's residual when --margin-from gives one."""
    from vramledger.inputs.units import format_bytes, parse_bytes
    from vramledger.inputs.verdict import DEFAULT_MARGIN, MARGIN_SOURCE

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

    from vramledger.inputs.jsonfile import read_json_object

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
    from vramledger.plan.search import plan
    from vramledger.plan.workers import start_fork_server
    from vramledger.render.planning import plan_table, plan_timing

    if args.workers is None or args.workers > 1:
        start_fork_server()  # its imports overlap this process's own (as fit's)
    gpu = _gpu(args)
    margin, source = _margin(args)
    optimizers = _names(args.optimizers, "--optimizers")
    spec = checked_spec(args, optimizers=optimizers)
    precisions = [canonical_precision(name) for name in _names(args.precisions, "--precisions")]
    result = with_progress(
        args,
        lambda progress: plan(
            spec,
            gpu,
            optimizers=optimizers,
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
    return report(args, result, plan_table, timing=plan_timing)


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
    from vramledger.inputs.units import parse_bytes

    return parse_bytes(args.host_memory, option="--host-memory") if args.host_memory else None


def cmd_advise(args: argparse.Namespace) -> int:
    from vramledger.plan.advise import DEFAULT_GPUS_PER_NODE, advise
    from vramledger.render.planning import advice_table

    gpu = _gpu(args)
    margin, _ = _margin(args)
    advice = advise(
        checked_spec(args),
        gpu,
        margin=margin,
        host_memory=_host_memory(args),
        gpus_per_node=args.gpus_per_node or DEFAULT_GPUS_PER_NODE,
    )
    return report(args, advice, advice_table)


def cmd_fit(args: argparse.Namespace) -> int:
    from vramledger.plan.fit import fit
    from vramledger.plan.workers import start_fork_server
    from vramledger.render.planning import fit_table, fit_timing

    if args.workers is None or args.workers > 1:
        start_fork_server()
    optimizers = _names(args.optimizers, "--optimizers") if args.optimizers else None
    spec = checked_spec(args, optimizers=optimizers)
    gpu = spec.gpu_kind()
    if gpu is None:
        raise InputError("fit needs a GPU", hint="pass --gpu NAME or --gpu-memory SIZE")
    checkpointing = {"both": (False, True), "on": (True,), "off": (False,)}[args.checkpointing]
    result = fit(
        spec,
        gpu,
        maximize=args.maximize,
        optimizers=optimizers,
        checkpointing=checkpointing,
        margin=spec.margin_bytes,
        seq_step=args.seq_step,
        workers=args.workers,
    )
    return report(args, result, fit_table, timing=fit_timing)


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
    from vramledger.plan.rehearse import rehearse
    from vramledger.render.planning import rehearsal_table
    from vramledger.render.plots import rehearsal_plot

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
    spec = checked_spec(args)
    result = with_progress(
        args,
        lambda progress: rehearse(
            spec, depths=depths, widths=widths, device=args.device, progress=progress
        ),
    )
    return report(args, result, rehearsal_table, rehearsal_plot)


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vramledger.cli.serve.app import serve

    return serve(
        Path(args.dir) if args.dir else None,
        host=args.host,
        port=args.port,
        code=Path(args.allow_code) if args.allow_code else None,
        debug=args.debug,
    )


def cmd_compat(args: argparse.Namespace) -> int:
    """The patch registry checked against the installed libraries; exit status
    ``PATCH_MISSING_EXIT`` when a target of an installed package in its tested range is
    missing."""
    import functools

    from vramledger.inputs.patch_check import check_patches
    from vramledger.render.patches import patch_table

    result = check_patches()
    report(args, result, functools.partial(patch_table, every=args.every))
    return PATCH_MISSING_EXIT if result.failed else 0
