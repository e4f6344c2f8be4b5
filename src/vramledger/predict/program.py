"""``run_program``: predict the memory of the user's own program, run unchanged with CUDA
emulated on fake tensors (``trace/program/program_trace.py``), as the ledger ``estimate`` gives.

The ledger is ``build_ledger``'s over the program's timeline (steps are the program's
optimizer steps, all optimizers counted; steady = steps >= 2), with each optimizer's steady
window beside it (``windows.py``). A program stopped before its second step has no steady
state: the report then holds what was seen (the peak so far, by category) and no ledger.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from vramledger.inputs.categories import Category
from vramledger.inputs.gpus import Gpu, resolve_gpu
from vramledger.inputs.notes import NOTE_FIELDS, Note, Topic, records
from vramledger.inputs.program import ProgramSpec
from vramledger.inputs.torchrun_env import TorchrunRank
from vramledger.inputs.verdict import DEFAULT_MARGIN, verdict
from vramledger.inputs.version import __version__
from vramledger.ledger.ledger import Ledger, build_ledger, replay, worst_rank_ledger
from vramledger.parallel.program_pipeline import StageMail
from vramledger.parallel.program_world import ProgramWorld
from vramledger.predict.step import policy_for
from vramledger.predict.windows import OptimizerWindow, optimizer_windows
from vramledger.trace.emulation.cuda_api import EmulatedGpu
from vramledger.trace.program.host_tensors import HostTensor
from vramledger.trace.program.program_blocks import trace_program_blocks
from vramledger.trace.program.program_trace import trace_program

DEFAULT_GPU = "h100-80gb"
"""What ``torch.cuda.get_device_properties`` describes when no ``--gpu`` is given (compute
capability 9.0, the trace's default, ``gpus.DEFAULT_COMPUTE_CAPABILITY``)."""


@dataclass(frozen=True)
class _Target:
    """What ``predict.policy_for`` reads of a spec: the target and its GPU."""

    target: str
    gpu: Gpu | None

    def gpu_kind(self) -> Gpu | None:
        return self.gpu


def emulated_gpu(gpu: Gpu, device_count: int = 1) -> EmulatedGpu:
    major, minor = gpu.compute_capability or (9, 0)
    return EmulatedGpu(
        name=gpu.name,
        total_memory=gpu.memory_bytes,
        major=major,
        minor=minor,
        device_count=device_count,
    )


@dataclass(frozen=True, kw_only=True)
class ProgramReport:
    """A program's predicted memory: the ledger (None before a second step), each optimizer's
    window, and how the program ran."""

    program: str
    target: str
    ending: str
    """'ended', 'max-steps' (stopped after ``--max-steps``) or 'timeout'."""
    steps: int
    optimizers: list[str]
    windows: list[OptimizerWindow]
    peak_bytes: int
    """The most device memory held at once over the whole program, as the allocator counts it
    (``torch.cuda.max_memory_allocated()`` with no reset)."""
    at_peak: dict[Category, int]
    """Bytes by category there (tensor bytes)."""
    step_peaks: dict[int, int]
    """Each step's peak, as the allocator counts it."""
    ledger: Ledger | None
    notes: list[str] = field(default_factory=list)
    host_tensors: list[HostTensor] = field(default_factory=list)
    """Host tensors the program kept after its last step (``trace/program/host_tensors.py``): memory a
    real CPU run's allocator counts and this prediction does not."""
    unified_memory_bytes: int = 0
    """Paged optimizer states in CUDA unified memory (``trace/emulation/paged_states.py``): on the GPU
    while it has room, outside the allocator's count and this peak."""
    trained_on_host_bytes: int = 0
    """Bytes of the parameters the program trained on the host, having trained none on the
    emulated GPU (``trace/program/program_trace.py``, ``_trained_on_host``): the answer is not its
    training's (:data:`TRAINED_ON_HOST`)."""
    exit_code: int = 0
    seconds: float = 0.0
    world_size: int = 1
    """Ranks the program ran as (``--nnodes x --nproc-per-node``)."""
    rank: int = 0
    """The rank this report describes: on several ranks, the one with the largest peak."""
    ranks: list[tuple[list[int], ProgramReport]] = field(
        default_factory=list, repr=False, compare=False
    )
    """On several ranks, one entry per distinct rank's report: the ranks that share it, and
    the report (its ledger is the one in ``ledger.ranks``)."""

    def to_dict(self) -> dict[str, Any]:
        return with_rank_programs(self._dict(), self.world_size, self.rank, self.ranks)

    def _dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self.ledger.to_dict() if self.ledger is not None else {}
        out.update(
            program=self.program,
            target=self.target,
            ending=self.ending,
            steps=self.steps,
            optimizers=self.optimizers,
            optimizer_windows=[w.to_dict() for w in self.windows],
            program_peak_bytes=self.peak_bytes,
            program_at_peak={c.value: b for c, b in self.at_peak.items() if b},
            step_peaks={str(k): v for k, v in self.step_peaks.items()},
            notes=self.notes,
            note_records=records(self.notes),
            host_tensors=[h.to_dict() for h in self.host_tensors],
            host_bytes=sum(h.nbytes for h in self.host_tensors),
            unified_memory_bytes=self.unified_memory_bytes,
            trained_on_host_bytes=self.trained_on_host_bytes,
            exit_code=self.exit_code,
            seconds=round(self.seconds, 3),
        )
        return out


TRAINED_ON_HOST = (
    "the program trained {nbytes:,} bytes of parameters on the CPU and nothing on the GPU: "
    "it chose its device without asking for 'cuda' (or saw no GPU), so this answer counts "
    "none of its training"
)
"""Said (as a note, and on the standard error with a non-zero exit) where
``trained_on_host_bytes`` is set."""


EVERY_BLOCK_PER_RANK = Note(
    Topic.EXTENT,
    "each rank traced every block of its model (the block extension is not applied to a "
    "program run as several ranks)",
)


def run_program(
    spec: ProgramSpec, *, target: str = "cuda", gpu: str | Gpu | None = None
) -> ProgramReport:
    """Run ``spec``'s program with CUDA emulated for ``gpu`` (default H100 80GB) on fake
    tensors, under ``target``'s device policy ('cuda', or 'cpu' to predict what a CPU run's
    allocator counts), and report its memory. With ``spec.world_size`` > 1 the program runs
    once per rank, as torchrun would launch it (``parallel/program_world.py``), and the
    report is the worst rank's with every distinct rank's in ``ranks`` (as ``estimate``)."""
    if spec.world_size == 1:
        return _run_rank(spec, target, gpu, None)
    mail = StageMail()  # what the ranks' pipeline stages tell each other

    def one(rank: int) -> tuple[int, ProgramReport, str]:
        where = TorchrunRank(rank=rank, nproc_per_node=spec.nproc_per_node, nnodes=spec.nnodes)
        world = ProgramWorld(where, mail)
        return rank, _run_rank(spec, target, gpu, world), world.strategy

    reports = [one(rank) for rank in range(spec.world_size)]
    for rank in mail.retrace():  # a later rank's pipeline vote changed what this one assumed
        reports[rank] = one(rank)
    return _ranks_report(spec, reports)


def _run_rank(
    spec: ProgramSpec, target: str, gpu: str | Gpu | None, world: ProgramWorld | None
) -> ProgramReport:
    """One run of the program (one rank of ``world``, or the only one)."""
    kind = gpu if isinstance(gpu, Gpu) else resolve_gpu(gpu or DEFAULT_GPU)
    policy = policy_for(_Target(target, kind if gpu is not None else None))
    if world is None:
        traced = trace_program_blocks(spec, policy, emulated_gpu(kind))
    else:  # each rank runs its program as it is: every block
        traced = trace_program(spec, policy, emulated_gpu(kind, spec.nproc_per_node), world)
        traced = replace(traced, notes=[*traced.notes, EVERY_BLOCK_PER_RANK])
    timeline, run = traced.timeline, traced.run
    blocks = replay(timeline, policy.allocator)
    step_peaks = {k: p.total for k, p in blocks.step_peaks.items() if k >= 1}
    raw = replay(timeline)
    seen = max(raw.step_peaks.values(), key=lambda p: p.total, default=None)
    notes = [*traced.notes, Note(Topic.PROGRAM, _ending_note(run.ending, run.steps, spec))]
    if traced.trained_on_host_bytes:
        trained = TRAINED_ON_HOST.format(nbytes=traced.trained_on_host_bytes)
        notes.insert(0, Note(Topic.PROGRAM, trained))
    ledger = None
    if timeline.steps >= 2:
        ledger = build_ledger(
            timeline,
            target=target,
            allocator=policy.allocator,
            parameters=traced.parameters,
            trainable_parameters=traced.trainable_parameters,
            optimizer_state_bytes=max(
                (p.by_category.get(Category.OPTIMIZER_STATE, 0) for p in raw.step_peaks.values()),
                default=0,
            ),
            spec={"program": spec.program, "args": list(spec.args), "target": target},
            notes=notes,
            seconds=traced.seconds,
            version=__version__,
        )
        ledger = replace(ledger, blocks_extended=traced.extended)
        if target == "cuda" and gpu is not None:
            ledger = replace(
                ledger,
                verdict=verdict(kind, ledger.reserved_peak_bytes, DEFAULT_MARGIN),
            )
    return ProgramReport(
        program=" ".join([spec.program, *spec.args]),
        target=target,
        ending=run.ending,
        steps=run.steps,
        optimizers=list(run.optimizer_names),
        windows=optimizer_windows(step_peaks, run),
        peak_bytes=max((p.total for p in blocks.step_peaks.values()), default=0),
        at_peak=dict(seen.by_category) if seen is not None else {},
        step_peaks=step_peaks,
        ledger=ledger,
        notes=notes,
        host_tensors=traced.host_tensors,
        unified_memory_bytes=traced.unified_memory_bytes,
        trained_on_host_bytes=traced.trained_on_host_bytes,
        exit_code=run.exit_code,
        seconds=traced.seconds,
    )


RANK_FIELDS = ("ending", "steps", "optimizer_windows", "program_peak_bytes", "step_peaks")
"""What ``rank_programs`` gives of each distinct rank's run (its ledger is in ``ranks``)."""


def _rank_fields(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report[k] for k in RANK_FIELDS}


def with_rank_programs(
    out: dict[str, Any], world_size: int, rank: int, ranks: Iterable[tuple[list[int], Any]]
) -> dict[str, Any]:
    """``out``, a program's report or measurement as JSON, with (on several ranks) the rank it
    describes and ``rank_programs``: each distinct rank's ``RANK_FIELDS`` (``ranks``: the ranks
    sharing a report or measurement, and it)."""
    if world_size > 1:
        out.update(
            world_size=world_size,
            rank=rank,
            rank_programs=[{"rank_ids": ids, **_rank_fields(r._dict())} for ids, r in ranks],
        )
    return out


def _signature(report: ProgramReport) -> str:
    """What must be equal for two ranks to share a report: every figure, not the notes (which
    name the rank) or the time taken."""
    out = report._dict()
    for key in (*NOTE_FIELDS, "seconds", "ranks", "spec", "host_tensors", "host_bytes"):
        out.pop(key, None)
    return json.dumps(out, sort_keys=True, default=str)


def _ranks_report(spec: ProgramSpec, runs: list[tuple[int, ProgramReport, str]]) -> ProgramReport:
    """The worst rank's report, with every distinct rank's (ranks whose figures are all equal
    share one) in ``ranks`` and in its ledger's ``ranks``, as ``estimate`` gives them."""
    groups: dict[str, tuple[list[int], ProgramReport]] = {}
    for rank, report, _ in runs:
        groups.setdefault(_signature(report), ([], report))[0].append(rank)
    distinct = list(groups.values())
    strategy = next((s for _, _, s in runs if s != "none"), "none")

    def size(item: tuple[list[int], ProgramReport]) -> int:
        report = item[1]
        return report.ledger.allocated_peak_bytes if report.ledger else report.peak_bytes

    ids, worst = max(distinct, key=size)
    note = Note(
        Topic.ENGINE,
        f"every rank of {spec.world_size} traced in turn, each a run of the program in this "
        f"process; {len(distinct)} distinct (ranks with equal figures share one ledger)",
    )
    ledger = worst.ledger
    if ledger is not None and all(r.ledger is not None for _, r in distinct):
        ledger = worst_rank_ledger(
            [(i, r.ledger) for i, r in distinct],  # type: ignore[misc]
            world_size=spec.world_size,
            strategy=strategy,
        )
        ledger = replace(ledger, notes=[*ledger.notes, note])
    return replace(
        worst,
        ledger=ledger,
        notes=[*worst.notes, note],
        world_size=spec.world_size,
        rank=ids[0],
        ranks=distinct,
        seconds=sum(r.seconds for _, r, _ in runs),
    )


def _ending_note(ending: str, steps: int, spec: ProgramSpec) -> str:
    made = f"{steps} optimizer step{'s' if steps != 1 else ''}"
    if ending == "max-steps":
        return f"the program was stopped after {made} (--max-steps {spec.max_steps})"
    if ending == "timeout":
        return f"the program was stopped after {spec.timeout:g} s (--timeout), having made {made}"
    return f"the program ran to its end ({made})"
