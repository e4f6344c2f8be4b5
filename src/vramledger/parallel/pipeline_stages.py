"""Pipeline stages: the model's layers split into stages as torchtitan splits them, the stages
each rank holds, the ranks that share a ledger, and what a pipeline-parallel spec must be
(``pipeline.py`` says how the stages run)."""

from __future__ import annotations

from dataclasses import dataclass

from vramledger.inputs.errors import InputError
from vramledger.inputs.spec import TrainingSpec
from vramledger.parallel.mesh import check_even_tp, mesh_coords

STAGES_PER_RANK: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}
"""Stages a rank holds: one for single-stage schedules, two for interleaved ones (torchtitan's
``pipeline_llm`` default when ``pipeline_parallel_layers_per_stage`` is not given)."""
INPUT_WEIGHT = 1
"""Layers the input embedding counts for in the split (torchtitan's
``pipeline_parallel_first_stage_less_layers`` default)."""
OUTPUT_WEIGHT = 1
"""Layers the final norm and output head count for (``pipeline_parallel_last_stage_less_layers``)."""
STAGE_PREFIX = "stage"
"""Each stage model a rank holds is its child ``stage{index}``."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its index and the model's layers it holds."""

    index: int
    num_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def name(self) -> str:
        return f"{STAGE_PREFIX}{self.index}"

    def words(self) -> str:
        parts = ["the input embedding"] if self.first else []
        if self.layers:
            parts.append(f"layers {self.layers.start}-{self.layers.stop - 1}")
        parts += ["the final norm and output head"] if self.last else []
        return f"stage {self.index} of {self.num_stages} ({', '.join(parts) or 'no layers'})"


def stage_layers(num_stages: int, num_layers: int) -> list[range]:
    """The layers of each stage, as torchtitan's ``generate_llm_fqn_per_model_part`` gives them
    (input embedding and output head weighing ``INPUT_WEIGHT`` / ``OUTPUT_WEIGHT`` layers)."""
    if num_stages == 1:
        return [range(num_layers)]
    effective = num_layers + INPUT_WEIGHT + OUTPUT_WEIGHT
    per_stage, extra = divmod(effective, num_stages)
    if per_stage == 0 or max(INPUT_WEIGHT, OUTPUT_WEIGHT) > per_stage:
        raise InputError(
            f"{num_stages} pipeline stages need at least {num_stages * max(1, INPUT_WEIGHT)} "
            f"layers counting the embedding and head as one each; the model has {num_layers}",
            hint="use fewer stages (--pp, or another --pp-schedule)",
        )
    out, current = [], 0
    for s in range(num_stages):
        n = per_stage + (1 if s < extra else 0)
        n -= INPUT_WEIGHT if s == 0 else OUTPUT_WEIGHT if s == num_stages - 1 else 0
        take = max(0, min(n, num_layers - current))
        out.append(range(current, current + take))
        current += take
    return out


def pp_rank(rank: int, spec: TrainingSpec) -> int:
    """The rank's place along the pipeline axis (``mesh.mesh_coords``: torchtitan's order, pp
    outermost)."""
    return mesh_coords(rank, spec)["pp"]


def rank_stage_plans(spec: TrainingSpec, rank: int, num_layers: int) -> list[StagePlan]:
    """The stages rank ``rank`` holds (the looped placement: ``p, p + pp, ...``)."""
    per_rank = STAGES_PER_RANK[spec.pp_schedule]
    num_stages = spec.pp * per_rank
    layers = stage_layers(num_stages, num_layers)
    p = pp_rank(rank, spec)
    return [StagePlan(i, num_stages, layers[i]) for i in range(p, num_stages, spec.pp)]


def microbatches(spec: TrainingSpec) -> int:
    return spec.microbatches or spec.pp


def pipeline_rank_groups(spec: TrainingSpec) -> list[list[int]]:
    """Ranks that share one ledger: those of the same pipeline rank (the same stages) are
    symmetric along the data-parallel axis (FSDP2 shards evenly; the traced rank, data-parallel
    rank 0, holds the largest shard) and along the tensor-parallel one (the plan's splits are
    checked even, ``mesh.check_even_tp``). Every pipeline rank differs: the first holds the
    embedding, the last the head and the loss, and 1F1B keeps a different number of
    micro-batches in flight on each."""
    check_pipeline_spec(spec)
    check_even_tp(spec)
    groups: dict[int, list[int]] = {}
    for rank in range(spec.world_size):
        groups.setdefault(pp_rank(rank, spec), []).append(rank)
    return [groups[p] for p in sorted(groups)]


def check_pipeline_spec(spec: TrainingSpec) -> None:
    """What the pipeline engine runs: a known schedule's micro-batch count; the other axes
    that are modelled with it."""
    m = microbatches(spec)
    if spec.pp_schedule == "1f1b" and m < spec.pp:
        raise InputError(
            f"1F1B needs at least as many micro-batches as stages ({spec.pp}), not {m}",
            hint=f"use --microbatches {spec.pp} or more",
        )
    if spec.pp_schedule == "interleaved-1f1b":
        rounds = max(1, m // spec.pp)
        if m % rounds:
            raise InputError(
                f"interleaved 1F1B needs the micro-batches to be a multiple of "
                f"{rounds} (micro-batches // pp), not {m}",
                hint=f"use --microbatches {rounds * spec.pp}",
            )
    if spec.cp > 1 or spec.ep > 1:
        axis = "context" if spec.cp > 1 else "expert"
        raise InputError(
            f"pipeline parallelism with {axis} parallelism is not modelled yet (with tensor "
            "parallelism and FSDP2 over the data-parallel axis it is)",
            hint=f"drop --{'cp' if spec.cp > 1 else 'ep'}, or estimate without --pp",
        )
    if spec.tp > 1 and spec.tp_plan is not None:
        raise InputError(
            "--tp-plan with pipeline parallelism: the hidden states between stages are sent as "
            "the default plan leaves them (each rank's part of the sequence), which a user plan "
            "need not do",
            hint="drop --tp-plan to use the model family's plan",
        )
    if spec.tp > 1 and spec.seq_len % spec.tp:
        raise InputError(
            f"sequence parallelism between pipeline stages splits the sequence ({spec.seq_len}) "
            f"over the {spec.tp} tensor-parallel ranks evenly",
            hint=f"use a --seq-len that is a multiple of {spec.tp}",
        )
    if spec.grad_accum > 1:
        raise InputError(
            "--grad-accum with pipeline parallelism: the micro-batches are the accumulation",
            hint="use --microbatches",
        )
    if spec.dp_degree > 1 and not spec.parallelism.is_fsdp:
        raise InputError(
            f"--strategy {spec.strategy} with pipeline parallelism is not modelled",
            hint="use fsdp over the data-parallel axis",
        )
