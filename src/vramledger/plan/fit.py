"""``fit``: the largest micro-batch and/or sequence length that fits a GPU.

Tracing every candidate size would be slow for a large model, so a few are traced and the rest
derived. Each storage of a training step has a size that is a polynomial in the batch size
(degree 1: per-example tensors) and in the sequence length (degree 2 at most: attention scores
are S×S), as long as the step runs the same operators. So the step is traced at two batch sizes
(three sequence lengths); when their timelines correspond storage for storage (same operators,
categories and events), every storage's bytes are interpolated to any size and the timeline is
replayed through the caching-allocator model — milliseconds per candidate — to find the largest
size whose reserved peak fits. Where the timelines do not correspond (an attention kernel that
changes with the length), sizes are found by estimating directly. Either way the answer and the
next size up are then re-estimated with ``estimate``: the answer fits, the next one does not
(``fits_next`` is False), moving the answer until both hold.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any, Literal

from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import Gpu
from vramledger.inputs.launch_configs import apply_configs
from vramledger.inputs.notes import Topic, records, topic_of
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.verdict import DEFAULT_MARGIN, check_margin, verdict
from vramledger.ledger.ledger import Ledger
from vramledger.ledger.replay import steady_peaks, steady_tensor_peak
from vramledger.plan.fit_estimates import FitEstimates, workers_for
from vramledger.record.allocator import CUDA_CACHING_ALLOCATOR
from vramledger.record.timeline import Timeline

Maximize = Literal["batch-size", "seq-len", "both"]
MAXIMIZE: tuple[str, ...] = Maximize.__args__  # type: ignore[attr-defined]
SEQ_STEP = 64
"""Sequence lengths are answered in multiples of this many tokens (the next size up is the answer
plus this); attention kernels tile the sequence in blocks of 64-128, so finer steps rarely
differ in memory."""
MAX_BATCH = 1 << 20
MAX_SEQ = 1 << 22


@dataclass(frozen=True, kw_only=True)
class FitAnswer:
    optimizer: str
    checkpointing: bool
    batch_size: int
    seq_len: int
    reserved_peak_bytes: int
    """What must fit: the caching allocator's reserved peak on CUDA (the allocated peak for a
    CPU target)."""
    headroom_bytes: int
    fits_next: bool
    """Whether the next size up fits (False for an answer: it is the largest)."""
    next_size: dict[str, int] = field(default_factory=dict)
    """The next size up that was re-estimated, and its reserved peak."""
    method: str = "derived from traces, answer and next size re-estimated"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class NoFit:
    """A configuration (optimizer, checkpointing) whose smallest size does not fit: what that
    size needs, estimated."""

    optimizer: str
    checkpointing: bool
    batch_size: int
    seq_len: int
    """The smallest size tried: a micro-batch of one, or one ``seq_step`` of tokens."""
    reserved_peak_bytes: int
    headroom_bytes: int
    """Negative: how much more the smallest size needs."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Fit:
    gpu: Gpu
    margin_bytes: int
    maximize: str
    answers: list[FitAnswer]
    """The largest size that fits per (optimizer, checkpointing); missing when even the
    smallest does not fit (then in ``no_fit``)."""
    seq_step: int
    estimates: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    no_fit: list[NoFit] = field(default_factory=list)
    """Each (optimizer, checkpointing) whose smallest size does not fit, with what it needs."""
    workers: int = 1
    """Processes that made estimates, this one included (``fit_estimates.py``)."""

    def rows(self) -> list[FitAnswer | NoFit]:
        """Every configuration asked, optimizer by optimizer, checkpointing off before on: its
        answers, or what its smallest size needs."""
        optimizers = list(dict.fromkeys(r.optimizer for r in [*self.answers, *self.no_fit]))
        return sorted(
            [*self.answers, *self.no_fit],
            key=lambda r: (optimizers.index(r.optimizer), r.checkpointing),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.to_dict(),
            "margin_bytes": self.margin_bytes,
            "maximize": self.maximize,
            "answers": [a.to_dict() for a in self.answers],
            "no_fit": [n.to_dict() for n in self.no_fit],
            "seq_step": self.seq_step,
            "estimates": self.estimates,
            "workers": self.workers,
            "seconds": round(self.seconds, 2),
            "notes": self.notes,
            "note_records": records(self.notes),
        }


def interpolate(timelines: dict[int, Timeline], x: int) -> Timeline | None:
    """The timeline at size ``x`` from timelines traced at other sizes whose storages correspond
    one to one: each storage's bytes the polynomial through the traced points (Lagrange, exact in
    rationals). None when they do not correspond."""
    if not corresponds(timelines):
        return None
    points = sorted(timelines)
    base = timelines[points[0]]
    # Lagrange's weights at x over one common denominator: bytes = sum(a_i * n_i) / d, each
    # storage's rounded to the nearest integer, halves to even (``round`` of a ``Fraction``).
    weights = []
    for i, xi in enumerate(points):
        w = Fraction(1)
        for j, xj in enumerate(points):
            if i != j:
                w *= Fraction(x - xj, xi - xj)
        weights.append(w)
    d = math.lcm(*(w.denominator for w in weights))
    a = [w.numerator * (d // w.denominator) for w in weights]
    columns = [timelines[xi].nbytes for xi in points]
    sizes = [
        max(0, _round_half_even(sum(map(operator.mul, a, ns)), d))
        for ns in zip(*columns, strict=True)
    ]
    return replace(base, nbytes=sizes, labels=dict(base.labels))


SIZE_FREE_COLUMNS = ("num_storages", "events", "op", "tags", "on_host", "marks")
"""What traces at several sizes must share for their bytes to be interpolated."""


def corresponds(timelines: dict[int, Timeline]) -> bool:
    """Whether timelines traced at several sizes have the same storages, events and tags: only
    their bytes differ, so ``interpolate`` can derive another size's."""
    first, *others = timelines.values()
    return all(other.same_as(first, SIZE_FREE_COLUMNS) for other in others)


def _line(points: Sequence[int], peaks: Sequence[int], x: int) -> float:
    """The straight line through (``points[i]``, ``peaks[i]``), at ``x``."""
    (x0, x1), (y0, y1) = points, peaks
    return y1 + (y1 - y0) / (x1 - x0) * (x - x1)


def _round_half_even(num: int, den: int) -> int:
    """``round(Fraction(num, den))`` for ``den > 0``, in integers."""
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2):
        return q + 1
    return q


def _reserved(tl: Timeline) -> int:
    return steady_peaks(tl, CUDA_CACHING_ALLOCATOR).reserved


def _derived_peak(tl: Timeline, cuda: bool) -> int:
    """What must fit: the caching allocator's reserved bytes on CUDA, the bytes allocated on CPU."""
    return _reserved(tl) if cuda else steady_tensor_peak(tl)


def device_peak(ledger: Ledger) -> int:
    return ledger.reserved_peak_bytes if ledger.target == "cuda" else ledger.allocated_peak_bytes


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Largest n in [lo, hi] with fits(n), for fits monotone (True then False); None if none."""
    if not fits(lo):
        return None
    n = lo
    while n < hi and fits(min(2 * n, hi)):
        n = min(2 * n, hi)
    if n == hi:
        return n
    return _bisect(fits, n, min(2 * n, hi))


class _Sizer:
    """Fits one (optimizer, checkpointing) configuration along one size."""

    def __init__(self, spec: TrainingSpec, gpu: Gpu, margin: int, runs: FitEstimates) -> None:
        self.spec = spec
        self.gpu = gpu
        self.margin = margin
        self.runs = runs
        self.ledgers: dict[tuple[int, int], Ledger] = {}
        """The estimates this configuration used, by (micro-batch, sequence length)."""
        self.cuda = spec.target == "cuda"

    def at(self, batch: int, seq: int) -> TrainingSpec:
        return replace(self.spec, batch_size=batch, seq_len=seq)

    def ledger(self, batch: int, seq: int) -> Ledger:
        key = (batch, seq)
        if key not in self.ledgers:
            self.ledgers[key] = self.runs.ledger(self.at(batch, seq))
        return self.ledgers[key]

    def ahead(self, *sizes: tuple[int, int]) -> None:
        """Have these sizes estimated ahead, while this process makes the one needed now."""
        self.runs.ahead(self.at(*size) for size in sizes)

    def fits(self, peak: int) -> bool:
        return verdict(self.gpu, peak, self.margin).fits

    def largest(
        self, along: str, fixed: int, points: Sequence[int], step: int, top: int
    ) -> int | None:
        """The largest multiple of ``step`` along ``along`` (batch or seq) that fits, the other
        size fixed: derived from traces at ``points`` (multiples of ``step``) when they
        correspond, else found with estimates; then confirmed."""

        def at(n: int) -> tuple[int, int]:
            return (n, fixed) if along == "batch" else (fixed, n)

        self.ahead(*(at(p * step) for p in points[1:]))
        ledgers = {p: self.ledger(*at(p * step)) for p in points}
        traced = {p: ledger.timeline for p, ledger in ledgers.items()}
        derived = None
        if corresponds(traced):  # type: ignore[arg-type]
            # Each derived size replays the whole timeline (a fraction of a second on a 70B
            # model): start from where the traced peaks' straight line crosses the budget.
            peaks = [device_peak(ledgers[p]) for p in points[-2:]]
            guess = _largest(lambda k: self.fits(_line(points[-2:], peaks, k)), 1, top // step)
            derived = (
                self._confirm(
                    lambda k: self.fits(_reserved(interpolate(traced, k))),  # type: ignore[arg-type]
                    guess or 1,
                    top // step,
                )
                or None
            )
        if derived is None:
            derived = _largest(
                lambda k: self.fits(device_peak(self.ledger(*at(k * step)))), 1, top // step
            )
            if derived is None:
                return None
        self.ahead(at((derived + 1) * step))  # the next size up, confirmed with the answer
        return (
            self._confirm(
                lambda k: self.fits(device_peak(self.ledger(*at(k * step)))),
                derived,
                top // step,
            )
            * step
        )

    @staticmethod
    def _confirm(fits: Callable[[int], bool], k: int, top: int) -> int:
        """The largest ``n`` that fits with ``n + 1`` not fitting, found from ``k`` (the derived
        answer) with estimates: ``k`` and ``k + 1`` when the derivation was right; otherwise
        steps that double away from ``k`` until they cross, then bisection (0: nothing fits)."""
        if fits(k):
            if k >= top or not fits(k + 1):
                return k
            good, step = k + 1, 2
            while good + step <= top and fits(good + step):
                good, step = good + step, 2 * step
            bad = min(good + step, top + 1)
        else:
            bad, step = k, 1
            while True:
                probe = bad - step
                if probe < 1:
                    if not fits(1):
                        return 0
                    good = 1
                    break
                if fits(probe):
                    good = probe
                    break
                bad, step = probe, 2 * step
        return _bisect(fits, good, bad)


def _bisect(fits: Callable[[int], bool], good: int, bad: int) -> int:
    """The largest n in [good, bad) that fits, given fits(good) and not fits(bad)."""
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def fit(
    spec: TrainingSpec,
    gpu: Gpu,
    *,
    maximize: str = "batch-size",
    optimizers: Sequence[str] | None = None,
    checkpointing: Sequence[bool] = (False, True),
    margin: int = DEFAULT_MARGIN,
    seq_step: int = SEQ_STEP,
    workers: int | None = None,
) -> Fit:
    """The largest micro-batch (``batch-size``), sequence length (``seq-len``, in multiples of
    ``seq_step``) or both (the longest sequence at each power-of-two micro-batch) that fits
    ``gpu``, for each optimizer with activation checkpointing off and on. ``workers``: processes
    making estimates, this one included (``fit_estimates.py``); None: one per CPU for models of
    a billion parameters or more, else 1."""
    if maximize not in MAXIMIZE:
        raise InputError(f"unknown --max {maximize!r}", hint=f"use {', '.join(MAXIMIZE)}")
    if seq_step < 1:
        raise InputError(f"--seq-step must be positive, not {seq_step}")
    check_margin(gpu, margin)
    start = time.perf_counter()
    spec, _ = apply_configs(spec)  # the launch's config files, once: variants keep their values
    if spec.target == "cuda":  # every estimate emulates this GPU; on CPU, gpu is a budget
        spec = replace(spec, gpu=gpu, gpu_memory=None, margin=margin)
    if workers is not None and workers < 1:
        raise InputError(f"--workers must be 1 or more, not {workers}")
    answers: list[FitAnswer] = []
    no_fit: list[NoFit] = []
    notes: list[str] = []
    estimates = 0
    extra, preload = workers_for(spec) if workers is None else (workers - 1, ())
    with FitEstimates(extra, preload) as runs:
        for optimizer in optimizers or [spec.optimizer]:
            for ckpt in checkpointing:
                base = replace(spec, optimizer=optimizer, grad_checkpointing=ckpt)
                sizer = _Sizer(base, gpu, margin, runs)
                sizes = _largest_sizes(sizer, maximize, seq_step)
                if not sizes:
                    no_fit.append(_smallest(sizer, maximize, seq_step))
                for batch, seq in sizes:
                    answers.append(_answer(sizer, batch, seq, maximize, seq_step, notes))
                estimates += len(sizer.ledgers)
        used = runs.workers + 1
    return Fit(
        seconds=time.perf_counter() - start,
        gpu=gpu,
        margin_bytes=margin,
        maximize=maximize,
        seq_step=seq_step,
        answers=answers,
        no_fit=no_fit,
        estimates=estimates,
        notes=notes,
        workers=used,
    )


def _answer(
    sizer: _Sizer, batch: int, seq: int, maximize: str, seq_step: int, notes: list[str]
) -> FitAnswer:
    """The answer (``batch``, ``seq``) of ``sizer``'s configuration with its next size up;
    the kernels its estimate assumed are added to ``notes``."""
    ledger = sizer.ledger(batch, seq)
    notes += [n for n in ledger.notes if topic_of(n) is Topic.KERNELS and n not in notes]
    nxt = (batch + 1, seq) if maximize == "batch-size" else (batch, seq + seq_step)
    next_ledger = sizer.ledger(*nxt)
    peak = device_peak(ledger)
    return FitAnswer(
        optimizer=sizer.spec.optimizer,
        checkpointing=sizer.spec.grad_checkpointing,
        batch_size=batch,
        seq_len=seq,
        reserved_peak_bytes=peak,
        headroom_bytes=verdict(sizer.gpu, peak, sizer.margin).headroom_bytes,
        fits_next=sizer.fits(device_peak(next_ledger)),
        next_size={
            "batch_size": nxt[0],
            "seq_len": nxt[1],
            "reserved_peak_bytes": device_peak(next_ledger),
        },
    )


def _largest_sizes(sizer: _Sizer, maximize: str, seq_step: int) -> list[tuple[int, int]]:
    """The (micro-batch, sequence length) answers of one configuration (``sizer.spec``): one
    when maximising one size, one per power-of-two micro-batch for ``both``; none fits: []."""
    base = sizer.spec
    if maximize == "batch-size":
        # a batch of one is degenerate (some views are already contiguous): trace 2 and 3
        batch = sizer.largest("batch", base.seq_len, (2, 3), 1, MAX_BATCH)
        return [(batch, base.seq_len)] if batch else []
    if maximize == "seq-len":
        seq = sizer.largest("seq", base.batch_size, (1, 2, 3), seq_step, MAX_SEQ)
        return [(base.batch_size, seq)] if seq else []
    sizes: list[tuple[int, int]] = []
    batch = 1
    while batch <= MAX_BATCH:
        seq = sizer.largest("seq", batch, (1, 2, 3), seq_step, MAX_SEQ)
        if not seq:
            break
        sizes.append((batch, seq))
        batch *= 2
    return sizes


def _smallest(sizer: _Sizer, maximize: str, seq_step: int) -> NoFit:
    """A configuration none of whose sizes fits: its smallest size, and what that needs."""
    base = sizer.spec
    smallest = {
        "batch-size": (1, base.seq_len),
        "seq-len": (base.batch_size, seq_step),
        "both": (1, seq_step),
    }[maximize]
    peak = device_peak(sizer.ledger(*smallest))
    return NoFit(
        optimizer=base.optimizer,
        checkpointing=base.grad_checkpointing,
        batch_size=smallest[0],
        seq_len=smallest[1],
        reserved_peak_bytes=peak,
        headroom_bytes=verdict(sizer.gpu, peak, sizer.margin).headroom_bytes,
    )
