"""Parallelism: how ranks share the work, as one value the code asks questions of.

torchtitan's ``ParallelDims`` is the model: the strategy name and the axes (world size, dp_shard,
tp, pp, cp, ep) go in, and the rest of the package asks properties (``shards_params``,
``is_deepspeed``, ``dp_shard_enabled``, ...) instead of comparing strategy names. The names stay
the user-facing values (``--strategy``, the JSON ``strategy`` field); this module is the one place
that knows what each name means (``parallel/strategy.py`` says what each keeps on a rank).

=============  =========  ==========  ============  ===========  ==================
strategy       engine     parameters  gradients     optimizer    optimizer over
=============  =========  ==========  ============  ===========  ==================
``none``       -          whole       whole         whole        -
``ddp``        DDP        whole       whole         whole        -
``zero1``      DeepSpeed  whole       whole         partition    flat even slices
``zero2``      DeepSpeed  whole       partition     partition    flat even slices
``zero3``      DeepSpeed  partition   partition     partition    each parameter's
                                                                 even slice
``fsdp``       FSDP2      sharded     sharded       sharded      parameter shards
``zero1-       DDP        whole       whole         partition    whole parameters
torch``                                                          (ZeroRedundancyOptimizer)
``zero0``      DeepSpeed  whole       whole         whole        -
=============  =========  ==========  ============  ===========  ==================

``zero0``..``zero3`` are DeepSpeed's ZeRO stages everywhere (``--strategy``, a ``--deepspeed``
config's ``zero_optimization.stage``, a program's ``deepspeed.initialize``), and ``fsdp`` is
FSDP2 everywhere. ZeRO-3 partitions each parameter on its own into ``ceil(numel / N)``-element
slices (the last rank's padded), so every rank holds the same sizes.

``zero0`` is DeepSpeed's engine without ZeRO (``zero_optimization.stage`` 0): no DDP, its own
master-weight wrappers, and the gradients flattened into a transient buffer per reduction at the
accumulation boundary, on one process too (``engine.py``: ``buffered_allreduce_fallback``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vramledger.inputs.errors import InputError

Strategy = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp", "zero1-torch", "zero0"]
STRATEGIES: tuple[str, ...] = Strategy.__args__  # type: ignore[attr-defined]
"""How ranks share the work (``parallel/strategy.py`` says what each keeps on a rank)."""

Offload = Literal["none", "optimizer", "params", "both"]
OFFLOADS: tuple[str, ...] = Offload.__args__  # type: ignore[attr-defined]
"""What is kept in host memory."""

MAX_RANKS = 2**17
"""131,072 ranks: above the largest GPU clusters built for training (100,000 H100s in xAI's
Colossus, 2024); a larger world size is a typo, and per-rank work grows with it
(``--world-size 100000000`` grew to 20 GB and was killed)."""

_FSDP = frozenset({"fsdp"})
_DDP = frozenset({"ddp", "zero1-torch"})
_DEEPSPEED_STAGE = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}
_NEXT_DEEPSPEED = {"ddp": "zero1", "zero0": "zero1", "zero1": "zero2"}
Engine = Literal["none", "ddp", "zero-redundancy-optimizer", "deepspeed", "fsdp2"]
"""The engine that runs a strategy (the JSON ``engine`` field), so a reader never needs the
strategy names' vocabulary."""


def engine_of(strategy: str) -> str:
    """The engine of a ledger's ``strategy`` (the JSON ``engine`` field): of one strategy name
    (:attr:`Parallelism.engine`), or of a program's, several joined by ``+`` (``tp+fsdp``): its
    data-parallel engines' (tensor and pipeline parallelism, ``tp``/``pp``, are no
    data-parallel engine), ``none`` when it has none."""
    engines = [Parallelism(strategy=s).engine for s in strategy.split("+") if s in STRATEGIES]
    return "+".join(dict.fromkeys(e for e in engines if e != "none")) or "none"


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """A strategy name and the parallel axes; ``None`` reads as ``"none"`` (one rank)."""

    strategy: str | None = "none"
    """One of ``STRATEGIES``."""
    world_size: int = 1
    """Ranks: data-parallel x tp x pp x cp."""
    dp_shard: int | None = None
    """Ranks of the FSDP axis when given (``--dp-shard``)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks (borrowed from dp x cp)."""
    offload: str = "none"
    """What is kept in host memory: none, optimizer, params, both."""

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {STRATEGIES}")

    @classmethod
    def resolve(
        cls,
        *,
        strategy: str | None,
        world_size: int,
        nodes: int | None,
        gpus_per_node: int | None,
        dp_shard: int | None,
        tp: int,
        pp: int,
        cp: int,
        ep: int,
        offload: str,
    ) -> Parallelism:
        """The parallel options as a user gives them (``--world-size`` or ``--nodes`` x
        ``--gpus-per-node``, the axes, ``--strategy``, ``--offload``), checked, and resolved:
        the world size made from the nodes or the axes where not given, the strategy defaulted
        (none on one rank, ddp on several, fsdp when the model is split, the data-parallel axis
        given as ``--dp-shard`` or experts split over it). A bad value is an ``InputError``."""
        for name, value in (
            ("world_size", world_size),
            ("nodes", nodes),
            ("gpus_per_node", gpus_per_node),
        ):
            _check_ranks(name, value)
        if (nodes is None) != (gpus_per_node is None):
            raise InputError(
                "give --nodes and --gpus-per-node together", hint="or just --world-size"
            )
        if nodes is not None and gpus_per_node is not None:
            world = nodes * gpus_per_node
            if world_size not in (1, world):
                raise InputError(f"world-size {world_size} is not nodes x gpus-per-node = {world}")
            world_size = world
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("dp_shard", dp_shard)):
            _check_ranks(name, value)
        split = tp * pp * cp
        if dp_shard is not None:
            world = dp_shard * split
            if world_size not in (1, world):
                raise InputError(
                    f"world-size {world_size} is not dp-shard x tp x pp x cp = {world}",
                    hint="drop --world-size, or make the axes multiply to it",
                )
            world_size = world
        elif split > 1 and world_size == 1:
            world_size = split
        if world_size % split:
            raise InputError(
                f"world-size {world_size} is not a multiple of tp x pp x cp = {split}",
                hint="the data-parallel axis takes world-size / (tp x pp x cp) ranks",
            )
        dp = world_size // split
        if (dp * cp) % ep:
            raise InputError(
                f"ep {ep} does not divide the data-parallel x context-parallel ranks ({dp * cp})",
                hint="expert parallelism borrows ranks from those axes",
            )
        return cls(
            strategy=_default_strategy(strategy, dp, cp, dp_shard, split, ep, world_size),
            world_size=world_size,
            dp_shard=dp_shard,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            offload=_check_offload(offload),
        )

    @property
    def name(self) -> str:
        """The strategy's user-facing name (``"none"`` for ``None``)."""
        return self.strategy or "none"

    # --- which engine ---------------------------------------------------------------------

    @property
    def is_single(self) -> bool:
        """No data-parallel strategy: each rank keeps the whole model and reduces nothing."""
        return self.name == "none"

    @property
    def is_data_parallel(self) -> bool:
        """A data-parallel strategy that reduces gradients over ranks (anything but none)."""
        return not self.is_single

    @property
    def is_ddp(self) -> bool:
        """Runs under DistributedDataParallel's reducer: ddp and zero1-torch."""
        return self.name in _DDP

    @property
    def is_fsdp(self) -> bool:
        """Runs under FSDP2 ``fully_shard``: fsdp."""
        return self.name in _FSDP

    @property
    def is_deepspeed(self) -> bool:
        """Runs under DeepSpeed's engine: zero0, zero1, zero2 and zero3."""
        return self.name in _DEEPSPEED_STAGE

    @property
    def deepspeed_stage(self) -> int | None:
        """DeepSpeed's ZeRO stage (0, 1, 2 or 3), else None."""
        return _DEEPSPEED_STAGE.get(self.name)

    @property
    def is_deepspeed_zero(self) -> bool:
        """Runs under DeepSpeed's ZeRO optimizer, which partitions over the ranks: zero1, zero2,
        zero3."""
        return bool(self.deepspeed_stage)

    @property
    def is_deepspeed_zero3(self) -> bool:
        """Runs under DeepSpeed's ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): zero3."""
        return self.deepspeed_stage == 3

    @property
    def engine(self) -> Engine:
        """The engine that runs the strategy (the JSON ``engine`` field)."""
        if self.is_deepspeed:
            return "deepspeed"
        if self.is_fsdp:
            return "fsdp2"
        if self.is_zero_redundancy:
            return "zero-redundancy-optimizer"
        return "ddp" if self.is_ddp else "none"

    @property
    def is_zero_redundancy(self) -> bool:
        """zero1-torch: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer``."""
        return self.name == "zero1-torch"

    # --- what is sharded --------------------------------------------------------------------

    @property
    def shards_params(self) -> bool:
        """Parameters are sharded over the data-parallel ranks (FSDP2, DeepSpeed ZeRO-3); what
        FSDP2 alone does (its wrapping, its mixed precision, its mesh axis) asks ``is_fsdp``."""
        return self.is_fsdp or self.is_deepspeed_zero3

    @property
    def shards_grads(self) -> bool:
        """Gradients are sharded or partitioned over the data-parallel ranks (zero2, zero3,
        FSDP)."""
        return self.is_fsdp or self.deepspeed_stage in (2, 3)

    @property
    def shards_optimizer_state(self) -> bool:
        """Optimizer state is split over the data-parallel ranks (every ZeRO stage, FSDP)."""
        return self.is_fsdp or self.is_deepspeed_zero or self.is_zero_redundancy

    @property
    def partitions_optimizer(self) -> bool:
        """A ZeRO optimizer splits the state while parameters stay whole (zero1, zero2,
        zero1-torch): a rank's optimizer step and its state depend on which rank it is. Not
        zero3: it slices every parameter evenly, so every rank holds the same sizes."""
        return self.deepspeed_stage in (1, 2) or self.is_zero_redundancy

    @property
    def next_deepspeed_strategy(self) -> str | None:
        """The strategy that shards one more thing with DeepSpeed's ZeRO: zero1 after ddp,
        zero2 after zero1; else None."""
        return _NEXT_DEEPSPEED.get(self.name)

    @property
    def upgrades_to_zero3(self) -> bool:
        """ddp, zero1 or zero2: every rank holds the whole parameters under DDP's or DeepSpeed's
        engine, and ZeRO-3/FSDP would shard them (the advice's next step: zero3 under
        DeepSpeed's engine, fsdp under DDP's; zero1-torch is left out, as ``plan`` leaves it
        out)."""
        return self.is_data_parallel and not self.shards_params and not self.is_zero_redundancy

    @property
    def rank_independent(self) -> bool:
        """Every rank's events are the same up to the world size (DeepSpeed ZeRO-1/2's flat
        partition makes them differ by rank; ZeRO-3's even slice of each parameter does not)."""
        return self.deepspeed_stage not in (1, 2)

    @property
    def extends_blocks(self) -> bool:
        """A trace of some identical blocks extends to all of them: not under ZeRO-1/2 or
        zero1-torch (a rank owns different parameters in each block), nor under DeepSpeed's
        engine without ZeRO (it flattens every gradient at once, and its wrappers' steps did not
        extend: the 4/5-block pair differed), nor under ZeRO-3 (its sub-groups, prefetch and
        live-parameter limits and reduce bucket are thresholds in elements, not per block)."""
        return not self.partitions_optimizer and not self.is_deepspeed

    @property
    def models_split_model(self) -> bool:
        """Modelled with tensor, pipeline or context parallelism: none, ddp, fsdp (not
        DeepSpeed's engine, zero3 included, nor a ZeRO optimizer's partition)."""
        return not self.partitions_optimizer and not self.is_deepspeed

    # --- axes ------------------------------------------------------------------------------

    @property
    def dp_shard_enabled(self) -> bool:
        """The data-parallel axis is FSDP's ``dp_shard`` (else DDP's ``dp_replicate``)."""
        return self.is_fsdp

    @property
    def model_split(self) -> int:
        """Ranks one copy of the model is split over: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def data_parallel_degree(self) -> int:
        """Ranks of the data-parallel axis (replicas or FSDP shards)."""
        return self.world_size // self.model_split

    @property
    def offloads(self) -> bool:
        """Something is kept in host memory."""
        return self.offload != "none"


def _check_ranks(name: str, value: int | None) -> None:
    """A count of ranks (or None, not given): a positive integer, at most ``MAX_RANKS``."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{name.replace('_', '-')} must be a positive integer, not {value!r}")
    if value > MAX_RANKS:
        raise InputError(
            f"{name.replace('_', '-')} {value:,} is beyond any training cluster "
            f"(vramledger models at most {MAX_RANKS:,} ranks)",
            hint="check the number",
        )


def _default_strategy(
    strategy: str | None, dp: int, cp: int, dp_shard: int | None, split: int, ep: int, world: int
) -> str:
    """The strategy given, or the default: fsdp where the data-parallel axis is sharded
    (``--dp-shard``, a split model, experts split over it) and ranks reduce gradients
    (context-parallel ranks reduce theirs as data-parallel ones do: torchtitan shards over
    dp_shard x cp), ddp over plain data parallelism, none on one rank; checked against what is
    modelled."""
    sharded = dp_shard is not None or split > 1 or ep > 1
    chosen = strategy or ("ddp" if dp > 1 and not sharded else None)
    if chosen is None:
        chosen = "fsdp" if dp * cp > 1 else "none"
    if chosen not in STRATEGIES:
        raise InputError(
            f"unknown strategy {chosen!r}", hint=f"use one of {', '.join(STRATEGIES[1:])}"
        )
    parallelism = Parallelism(strategy=chosen)
    if parallelism.is_single and dp * cp > 1:
        raise InputError(
            f"world-size {world} needs a --strategy (data-parallel and "
            "context-parallel ranks reduce their gradients)",
            hint=f"use one of {', '.join(STRATEGIES[1:])}",
        )
    if split > 1 and not parallelism.models_split_model:
        raise InputError(
            f"--strategy {chosen} with tensor/pipeline/context parallelism is not modelled",
            hint="use fsdp (FSDP2) or ddp over the data-parallel axis",
        )
    return chosen


def _check_offload(offload: str) -> str:
    if offload not in OFFLOADS:
        raise InputError(f"unknown offload {offload!r}", hint=f"use one of {', '.join(OFFLOADS)}")
    return offload
