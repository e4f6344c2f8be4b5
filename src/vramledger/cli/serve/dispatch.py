"""Questions to workers: one question runs at a time, and a newer one cancels it.

A few worker processes (``worker.py``) are kept started, imports done: one answers, the others
wait ready. When a question arrives while another runs, the running one is cancelled by killing
its worker's whole process group (a trace cannot be interrupted half-way any other way, and a
plan's own helper processes go with it), and the new question goes to a ready worker at once; a
replacement starts in the background. A question that finds no ready worker waits, and a newer
one replaces it: however many arrive, at most one waits, so the queue is bounded by
construction. Answers are kept by question (``ANSWER_CACHE``): asking the same again is
answered at once. Every job's state is kept for the page to poll, the last ``MAX_JOBS`` of them.

Threads: HTTP handlers call ``ask``/``status``; one reader thread per worker delivers its
messages. One lock guards everything; nothing slow runs under it (a write of one line to a
worker's stdin, a kill).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vramledger.cli.serve.question import Question

log = logging.getLogger(__name__)

WORKERS = 2
"""Worker processes kept started: one answering, one ready to take the next question the
moment it cancels the running one (a fresh worker takes seconds to import torch)."""
MAX_JOBS = 200
"""Jobs whose state the server remembers for polling."""
ANSWER_CACHE = 64
"""Answers kept by question."""
MAX_START_FAILURES = 3
"""Workers that exit before they are ready, in a row, before the server stops starting them and
says why."""


@dataclass(kw_only=True)
class Job:
    id: int
    question: Question
    state: str = "waiting"
    """waiting, running, done, failed or cancelled."""
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    answer: dict[str, str] | None = None
    error: str | None = None
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        end = self.finished or time.monotonic()
        return {
            "job": self.id,
            "kind": self.question.kind,
            "state": self.state,
            "seconds": round(end - (self.started or self.created), 2),
            "progress": [[name, done, total] for name, (done, total) in self.progress.items()],
            "answer": self.answer,
            "error": self.error,
            "cached": self.cached,
        }


class Worker:
    """One worker process and the thread reading its messages."""

    def __init__(self, dispatcher: Dispatcher, *, warm_up: bool, debug: bool):
        read, write = os.pipe()
        command = [sys.executable, "-m", "vramledger.cli.serve.worker", str(write)]
        if not warm_up:
            command.append("--no-warm-up")
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=None if debug else subprocess.DEVNULL,
            pass_fds=(write,),
            start_new_session=True,  # its own process group: a kill takes its children too
            text=True,
        )
        os.close(write)
        self.messages = os.fdopen(read, encoding="utf-8")
        self.ready = False
        self.killed = False
        self.job: Job | None = None
        self.dispatcher = dispatcher
        threading.Thread(target=self._read, name=f"worker-{self.proc.pid}", daemon=True).start()

    def send(self, job: Job) -> None:
        assert self.proc.stdin is not None
        line = json.dumps({"job": job.id, "question": job.question.to_dict()})
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _read(self) -> None:
        for line in self.messages:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.dispatcher.on_message(self, message)
        self.messages.close()
        code = self.proc.wait()
        self.dispatcher.on_exit(self, code)


class Dispatcher:
    def __init__(self, *, workers: int = WORKERS, warm_up: bool = True, debug: bool = False):
        self.size = workers
        self.warm_up = warm_up
        self.debug = debug
        self.lock = threading.Lock()
        self.workers: list[Worker] = []
        self.jobs: OrderedDict[int, Job] = OrderedDict()
        self.answers: OrderedDict[str, dict[str, str]] = OrderedDict()
        self.waiting: Job | None = None
        self.ids = itertools.count(1)
        self.start_failures = 0
        self.broken: str | None = None
        self.closed = False

    # -- the HTTP side --------------------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            self._fill()

    def ask(self, question: Question) -> dict[str, Any]:
        """The state of a job for ``question``: answered from the cache, or run now, cancelling
        whatever runs or waits."""
        to_kill: list[Worker] = []
        with self.lock:
            state = self._ask(question, to_kill).to_dict()
        for worker in to_kill:  # outside the lock: their reader threads take it to report
            worker.kill()
        return state

    def _ask(self, question: Question, to_kill: list[Worker]) -> Job:
        """Under the lock: the job, and the busy workers to kill into ``to_kill``."""
        same = self._asked(question)
        if same is not None:  # asked again while it runs or waits: the same job
            return same
        job = Job(id=next(self.ids), question=question)
        self._remember(job)
        cached = self.answers.get(question.key())
        if cached is not None:
            self.answers.move_to_end(question.key())
            job.state, job.answer, job.cached = "done", cached, True
            job.started = job.finished = job.created
            return job
        if self.waiting is not None:
            self._cancel(self.waiting)
        for worker in self.workers:
            if worker.job is not None:
                self._cancel(worker.job)
                worker.job = None
                to_kill.append(worker)
        self.workers = [w for w in self.workers if w not in to_kill]
        if self.broken:
            job.state, job.error = "failed", self.broken
            job.finished = time.monotonic()
            return job
        self.waiting = job
        self._dispatch()
        self._fill()
        return job

    def status(self, job_id: int) -> dict[str, Any] | None:
        with self.lock:
            job = self.jobs.get(job_id)
            return None if job is None else job.to_dict()

    def workers_state(self) -> dict[str, Any]:
        with self.lock:
            return {
                "workers": [
                    {"pid": w.proc.pid, "ready": w.ready, "job": w.job.id if w.job else None}
                    for w in self.workers
                ],
                "waiting": self.waiting.id if self.waiting else None,
                "broken": self.broken,
            }

    def close(self) -> None:
        with self.lock:
            self.closed = True
            workers, self.workers = self.workers, []
        for worker in workers:
            worker.kill()

    # -- the workers' side ----------------------------------------------------------------------
    def on_message(self, worker: Worker, message: dict[str, Any]) -> None:
        with self.lock:
            if "ready" in message:
                worker.ready = True
                self.start_failures = 0
                log.info("worker %s ready in %.1f s", worker.proc.pid, message["ready"])
                self._dispatch()
                return
            job = worker.job
            if job is None or message.get("job") != job.id:
                return  # a cancelled job's last words
            if "progress" in message:
                name, done, total = message["progress"]
                job.progress[name] = (done, total)
                return
            job.finished = time.monotonic()
            if "answer" in message:
                job.state, job.answer = "done", message["answer"]
                self.answers[job.question.key()] = job.answer
                while len(self.answers) > ANSWER_CACHE:
                    self.answers.popitem(last=False)
            else:
                job.state, job.error = "failed", message.get("error", "vramledger: error")
            worker.job = None
            self._dispatch()

    def on_exit(self, worker: Worker, code: int) -> None:
        with self.lock:
            if worker in self.workers:
                self.workers.remove(worker)
            if worker.job is not None and worker.job.state == "running":
                worker.job.state = "failed"
                worker.job.error = (
                    f"vramledger: error: the worker answering this question stopped (exit code "
                    f"{code}; out of memory?); ask again"
                )
                worker.job.finished = time.monotonic()
            if not worker.ready and not worker.killed and not self.closed:
                self.start_failures += 1
                if self.start_failures >= MAX_START_FAILURES:
                    self.broken = (
                        f"vramledger: error: {MAX_START_FAILURES} worker processes exited while "
                        f"starting (last exit code {code}); start the server with --debug to see why"
                    )
                    if self.waiting is not None:
                        self.waiting.state, self.waiting.error = "failed", self.broken
                        self.waiting = None
            self._fill()

    # -- under the lock -------------------------------------------------------------------------
    def _fill(self) -> None:
        while not self.closed and not self.broken and len(self.workers) < self.size:
            self.workers.append(Worker(self, warm_up=self.warm_up, debug=self.debug))

    def _dispatch(self) -> None:
        if self.waiting is None:
            return
        for worker in self.workers:
            if worker.ready and worker.job is None and not worker.killed:
                job, self.waiting = self.waiting, None
                job.state, job.started = "running", time.monotonic()
                worker.job = job
                try:
                    worker.send(job)
                except OSError:  # it died just now: its reader thread fails the job
                    pass
                return

    def _cancel(self, job: Job) -> None:
        job.state = "cancelled"
        job.error = "cancelled: a newer question replaced it"
        job.finished = time.monotonic()
        if self.waiting is job:
            self.waiting = None

    def _asked(self, question: Question) -> Job | None:
        """The job running or waiting for the same question, if any."""
        key = question.key()
        for job in [self.waiting, *(w.job for w in self.workers)]:
            if job is not None and job.question.key() == key:
                return job
        return None

    def _remember(self, job: Job) -> None:
        self.jobs[job.id] = job
        while len(self.jobs) > MAX_JOBS:
            self.jobs.popitem(last=False)
