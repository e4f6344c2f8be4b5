"""One run (estimate and measure of one configuration) and the worker processes that make them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .build import BuildSkip, build_case, write_variants
from .cases import DISTRIBUTED_WORLD, Case, supported_tasks
from .errors import _exc_line, describe_error
from .settings import (
    BATCH_SIZE,
    OPTIMIZER,
    RUN_TIMEOUT_S,
    SEQ_LEN,
    TARGET,
    THREADS_PER_WORKER,
    WITHIN,
)


def spec_fields(path: Path, task: str, precision: str) -> dict[str, Any]:
    return dict(
        model=str(path),
        task=task,
        target=TARGET,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        optimizer=OPTIMIZER,
        precision=precision,
    )


def _param_bytes_per_param(ledger: dict[str, Any]) -> float | None:
    count = ledger.get("parameters") or 0
    held = ledger.get("at_peak", {}).get("parameters", 0)
    return round(held / count, 3) if count else None


def run_one(path: Path, task: str, precision: str) -> dict[str, Any]:
    """Estimate and measure one configuration; never raises."""
    from vramledger import estimate
    from vramledger.measure import measure

    fields = spec_fields(path, task, precision)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        ledger = estimate(**fields)
        est = ledger.to_dict()
        out["estimate_bytes"] = ledger.peak_bytes
        out["estimate_phase"] = est["peak_phase"]
        out["estimate_param_bytes_per_param"] = _param_bytes_per_param(est)
        out["parameters"] = ledger.parameters
    except Exception as exc:
        out["estimate_error"] = describe_error(exc)
    out["estimate_s"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    try:
        m = measure(device="cpu", **fields)
        real = m.ledger.to_dict()
        out["measured_bytes"] = m.measured_peak_bytes
        out["tracked_bytes"] = m.ledger.peak_bytes
        out["measured_phase"] = real["peak_phase"]
        out["measured_param_bytes_per_param"] = _param_bytes_per_param(real)
    except Exception as exc:
        out["measure_error"] = describe_error(exc)
    out["measure_s"] = round(time.perf_counter() - start, 2)
    has_est, has_real = "estimate_bytes" in out, "measured_bytes" in out
    if has_est and has_real:
        out["error"] = (out["estimate_bytes"] - out["measured_bytes"]) / out["measured_bytes"]
        out["status"] = "ok" if abs(out["error"]) <= WITHIN else "off"
    else:
        out["status"] = {
            (False, True): "estimate failed",
            (True, False): "measure failed",
            (False, False): "both failed",
        }[(has_est, has_real)]
    return out


MARK = "@@zoo "


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(record, default=str) + "\n")
    sys.stdout.flush()


def worker(case: Case, runs: list[tuple[str, str]], folder: Path) -> None:
    """Build the case and run ``runs`` ((precision, variant) pairs), one line per result."""
    import torch

    torch.set_num_threads(int(os.environ.get("ZOO_THREADS", THREADS_PER_WORKER)))
    try:
        built = build_case(case)
        paths = write_variants(built.config, folder)
    except BuildSkip as exc:
        _emit({"kind": "build", "status": "skipped", "reason": exc.reason, "detail": exc.detail})
        return
    except Exception as exc:
        _emit({"kind": "build", "status": "skipped", "reason": "build", "detail": _exc_line(exc)})
        return
    supported = case.task in supported_tasks()
    _emit(
        {
            "kind": "build",
            "status": "built",
            "parameters": built.parameters,
            "shrink": built.level,
            "shrink_attempts": built.attempts,
            "plain_step_error": built.plain_step_error,
            "config": str(paths["none"]),
            "supported": supported,
        }
    )
    if not supported:
        return
    for precision, variant in runs:
        result = run_one(paths[variant], case.task, precision)
        _emit({"kind": "run", "precision": precision, "variant": variant, **result})


def distributed_worker(case: Case, strategy: str, folder: Path) -> None:
    """Per-rank estimate and a real torchrun of the same step; one result line."""
    from vramledger import estimate
    from vramledger.measure.local import free_port

    path = write_variants(build_case(case).config, folder)["none"]
    fields = spec_fields(path, case.task, "fp32")
    out: dict[str, Any] = {"kind": "distributed"}
    try:
        ledger = estimate(world_size=DISTRIBUTED_WORLD, strategy=strategy, **fields)
        out["estimate"] = {str(r): led.peak_bytes for ids, led in ledger.ranks for r in ids}
        out["estimate_worst_rank"] = ledger.worst_rank
    except Exception as exc:
        out["estimate_error"] = describe_error(exc)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--nproc-per-node",
        str(DISTRIBUTED_WORLD),
        "--master-port",
        str(free_port()),
        "-m",
        "vramledger.cli",
        "measure",
        str(path),
        "--task",
        case.task,
        "--batch-size",
        str(BATCH_SIZE),
        "--seq-len",
        str(SEQ_LEN),
        "--optimizer",
        OPTIMIZER,
        "--precision",
        "fp32",
        "--strategy",
        strategy,
        "--target",
        TARGET,
        "--json",
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out["measure_s"] = round(time.perf_counter() - start, 2)
    if done.returncode != 0:
        out["measure_error"] = {"type": "torchrun", "message": _last_error_line(done.stderr)}
    else:
        data = json.loads(done.stdout)
        out["measured"] = {str(r["rank"]): r["measured_peak_bytes"] for r in data["ranks_measured"]}
        out["tracked"] = {str(r["rank"]): r["tracked_peak_bytes"] for r in data["ranks_measured"]}
    _emit(out)


def _last_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^(\w+(Error|Exception)|error:)", ln.strip())]
    return (errors[-1] if errors else lines[-1] if lines else "no output").strip()[:600]
