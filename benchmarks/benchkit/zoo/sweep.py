"""The parent: worker subprocesses with a timeout per run, and the per-rank sample."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .cases import Case, supported_tasks
from .settings import (
    DTYPE_VARIANTS,
    PRECISIONS,
    RUN_TIMEOUT_S,
    THREADS_PER_WORKER,
    WITHIN,
    ZOO_SCRIPT,
)
from .worker import MARK, _last_error_line


@dataclass
class Options:
    precisions: tuple[str, ...] = PRECISIONS
    variants: tuple[str, ...] = DTYPE_VARIANTS
    timeout_s: float = RUN_TIMEOUT_S
    threads: int = THREADS_PER_WORKER


def _spawn(args: list[str], threads: int) -> subprocess.Popen:
    env = {**os.environ, "ZOO_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(
        [sys.executable, str(ZOO_SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _lines(proc: subprocess.Popen, timeout_s: float) -> Iterator[dict[str, Any] | None]:
    """The worker's result lines; ``None`` once it has been silent for ``timeout_s`` (it is then
    killed)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(MARK):
                lines.put(line[len(MARK) :])
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            _kill(proc)
            yield None
            return
        if line is None:
            return
        yield json.loads(line)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Worker:
    """A worker subprocess: its result lines, each awaited at most ``timeout_s`` (then it is
    killed, with everything it started), and the last line of its stderr."""

    def __init__(self, args: list[str], threads: int) -> None:
        self.proc = _spawn(args, threads)
        self.timed_out = False
        self._stderr: list[str] = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self._stderr.append(self.proc.stderr.read())

    def results(self, timeout_s: float) -> Iterator[dict[str, Any]]:
        for line in _lines(self.proc, timeout_s):
            if line is None:
                self.timed_out = True
                return
            yield line

    def finish(self) -> str:
        """Wait for the worker; why it stopped, if it did not end cleanly."""
        code = self.proc.wait()
        self._reader.join()
        if self.timed_out:
            return "no result within the timeout"
        return f"exit code {code}: {_last_error_line(''.join(self._stderr))}"


def _case_record(base: dict[str, Any], status: str, **fields: Any) -> dict[str, Any]:
    return {**base, "precision": "-", "variant": "-", "status": status, **fields}


def run_case(case: Case, options: Options) -> list[dict[str, Any]]:
    """Every run of a case, in subprocesses: a worker that hangs or dies is replaced by a new
    one for the runs left after the one it was on."""
    base = {"arch": case.arch, "task": case.task, "class": case.class_name}
    pending = [(p, v) for p in options.precisions for v in options.variants]
    records: list[dict[str, Any]] = []
    build: dict[str, Any] | None = None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"zoo-{case.arch}-") as tmp:
        while pending:
            args = ["--_worker", case.arch, case.task, case.class_name, tmp]
            worker_ = Worker(args + [f"{p}/{v}" for p, v in pending], options.threads)
            finished: set[tuple[str, str]] = set()
            for line in worker_.results(options.timeout_s):
                if line["kind"] == "build":
                    build = line
                else:
                    finished.add((line["precision"], line["variant"]))
                    records.append({**base, **{k: v for k, v in line.items() if k != "kind"}})
            why = worker_.finish()
            status = "timeout" if worker_.timed_out else "crashed"
            if build is None:
                return [_case_record(base, "skipped", reason=status, detail=f"building: {why}")]
            if build["status"] == "skipped":
                return [
                    _case_record(base, "skipped", reason=build["reason"], detail=build["detail"])
                ]
            if not build["supported"]:
                detail = (
                    f"vramledger.inputs.sources.TASKS has no {case.task!r} "
                    f"(it has {', '.join(supported_tasks())})"
                )
                return [
                    _case_record(
                        base,
                        "unsupported task",
                        detail=detail,
                        model_parameters=build["parameters"],
                        shrink=build["shrink"],
                    )
                ]
            pending = [r for r in pending if r not in finished]
            if pending:  # the worker stopped on pending[0]: say why, go on with the rest
                (precision, variant), pending = pending[0], pending[1:]
                records.append(
                    {
                        **base,
                        "precision": precision,
                        "variant": variant,
                        "status": status,
                        "detail": why,
                    }
                )
    assert build is not None
    for r in records:
        r.update(
            shrink=build["shrink"],
            shrink_attempts=build["shrink_attempts"],
            plain_step_error=build["plain_step_error"],
            model_parameters=build["parameters"],
            case_s=round(time.perf_counter() - start, 1),
        )
    return sorted(records, key=lambda r: (r["precision"], r["variant"]))


def run_distributed(case: Case, strategy: str, options: Options) -> dict[str, Any]:
    """The per-rank estimate against a real 2-process gloo run (in a worker subprocess)."""
    base = {"arch": case.arch, "task": case.task, "strategy": strategy}
    with tempfile.TemporaryDirectory(prefix=f"zoo-dist-{case.arch}-") as tmp:
        args = ["--_distributed", case.arch, case.task, case.class_name, strategy, tmp]
        worker_ = Worker(args, options.threads)
        result = next(iter(worker_.results(2 * options.timeout_s)), None)
        why = worker_.finish()
    if result is None:
        return {**base, "status": "timeout" if worker_.timed_out else "crashed", "detail": why}
    return judge_distributed({**base, **{k: v for k, v in result.items() if k != "kind"}})


def judge_distributed(out: dict[str, Any]) -> dict[str, Any]:
    """Each rank's estimate against its real peak. The tracker's count of the real run decides
    (as tests/test_distributed_real.py compares: torch.profiler's memory events miss frees made
    on gloo's worker threads, so the allocator's count drifts high with timing); the error
    against the allocator's count is kept beside it."""
    if "estimate" in out and "measured" in out:
        per_rank = {}
        for rank, measured in out["measured"].items():
            est, tracked = out["estimate"].get(rank), out["tracked"][rank]
            per_rank[rank] = {
                "estimate": est,
                "measured": measured,
                "tracked": tracked,
                "error": (est - measured) / measured if est is not None else None,
                "error_vs_tracked": (est - tracked) / tracked if est is not None else None,
            }
        out["per_rank"] = per_rank
        known = [r for r in per_rank.values() if r["estimate"] is not None]
        out["worst_error_vs_tracked"] = max(
            (abs(r["error_vs_tracked"]) for r in known), default=None
        )
        out["worst_error"] = max((abs(r["error"]) for r in known), default=None)
        worst = out["worst_error_vs_tracked"]
        out["status"] = "ok" if worst is not None and worst <= WITHIN else "off"
    else:
        failed = ("estimate_error" in out, "measure_error" in out)
        out["status"] = {
            (True, False): "estimate failed",
            (False, True): "measure failed",
        }.get(failed, "both failed")
    return out


def sweep(
    cases: list[Case], options: Options, workers: int, progress: bool = True
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    done = [0]

    def one(case: Case) -> None:
        result = run_case(case, options)
        with lock:
            records.extend(result)
            done[0] += 1
            if progress:
                statuses = Counter(r["status"] for r in result)
                print(
                    f"[{done[0]}/{len(cases)}] {case.name}: "
                    + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())),
                    flush=True,
                )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, cases))
    records.sort(key=lambda r: (r["arch"], r["task"], r["precision"], r["variant"]))
    return records
