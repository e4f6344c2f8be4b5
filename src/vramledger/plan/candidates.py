"""What a plan is made of: configurations, the candidates that fit, what each costs besides
memory, and the Pareto front among them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vramledger.inputs.parallelism import Parallelism
from vramledger.inputs.spec import TrainingSpec

DEFAULT_GPUS_PER_NODE = 8
"""GPUs sharing one host's memory when offloading (an 8-GPU node: DGX/HGX)."""
RECOMPUTE_FRACTION = 1 / 3
"""Activation checkpointing recomputes the forward pass: about a third more compute."""
NUMERICS = {"bf16-true": "bf16 weights and optimizer state, no fp32 master copy"}
"""Precision modes that change what training computes beyond mixed precision's usual rounding."""
PLANNED_STRATEGIES: tuple[str, ...] = ("none", "ddp", "zero1", "zero2", "fsdp")
"""Strategies the plan searches: sharded parameters are FSDP2's (DeepSpeed's ZeRO-3, ``zero3``,
is estimated but not derived, ``derive.py``), and PyTorch's whole-parameter
ZeroRedundancyOptimizer (zero1-torch) never holds less than DeepSpeed's even ZeRO-1
partition."""
PLANNED_OFFLOADS = ("none", "optimizer")
STRATEGY_RANK = {s: i for i, s in enumerate(PLANNED_STRATEGIES)}

ESTIMATED = "estimated"
"""Re-estimated with the real engines (what ``estimate`` says for the configuration)."""
DERIVED = "derived"
"""Derived from a single-GPU trace (``derive.py``), not re-estimated."""


RUN_FIELDS = ("optimizer", "precision", "checkpointing", "micro_batch")
"""What a configuration and its layouts (``layouts.py``) share: the run on each GPU."""


@dataclass(frozen=True, kw_only=True)
class Configuration:
    optimizer: str
    precision: str
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    strategy: str
    offload: str
    gpus: int

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @property
    def parallelism(self) -> Parallelism:
        """The strategy as a value to ask (the GPU count aside: the derived layouts take it)."""
        return Parallelism(strategy=self.strategy, offload=self.offload)

    def spec(self, base: TrainingSpec) -> TrainingSpec:
        """The TrainingSpec ``estimate`` takes for this configuration."""
        return planned_spec(
            base,
            self,
            batch_size=self.micro_batch,
            grad_accum=self.grad_accum,
            world_size=self.gpus,
            strategy=self.strategy if self.gpus > 1 else None,
            offload=self.offload,
        )


def planned_spec(base: TrainingSpec, run: Any, **layout: Any) -> TrainingSpec:
    """``base`` as a plan estimates one of its answers: the optimizer, precision and
    checkpointing of ``run`` (a :class:`Configuration` or a layout of one) on a CUDA target, the
    GPUs given by ``layout`` (world size or axes), not by the user's nodes."""
    return replace(
        base,
        optimizer=run.optimizer,
        precision=run.precision,
        grad_checkpointing=run.checkpointing and not base.checkpoint_modules,
        nodes=None,
        gpus_per_node=None,
        target="cuda",
        **layout,
    )


@dataclass(frozen=True, kw_only=True)
class Candidate:
    configuration: Configuration
    peak_bytes_per_gpu: int
    """What the caching allocator reserves on the worst GPU at the peak."""
    headroom_bytes: int
    """GPU memory minus margin minus the peak (negative: does not fit)."""
    costs: dict[str, Any]
    method: str
    """``estimated`` with the real engines, ``derived`` from a single-GPU trace (with the
    plan's measured derivation error in ``error``), or ``estimated (does not fit)``."""
    host_bytes_per_node: int = 0
    """Host memory one node needs for what the configuration offloads."""
    error: str | None = None
    """For a derived candidate: how far derivations were from re-estimates in this plan."""

    @property
    def fits(self) -> bool:
        return self.method != f"{ESTIMATED} (does not fit)" and self.headroom_bytes >= 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.configuration.gpus,
            "configuration": self.configuration.to_dict(),
            "peak_bytes_per_gpu": self.peak_bytes_per_gpu,
            "headroom_bytes": self.headroom_bytes,
            "host_bytes_per_node": self.host_bytes_per_node,
            "costs": self.costs,
            "method": self.method,
            "derivation_error": self.error,
        }


def costs(
    config: Configuration, parameter_bytes: int, optimizer_changes: str | None
) -> dict[str, Any]:
    """What a configuration costs besides memory (per step, per GPU)."""
    grads = parameter_bytes
    comm = {
        "none": 0,
        "ddp": 2 * grads,
        "zero1": 2 * grads + parameter_bytes,
        "zero2": 2 * grads,
        "fsdp": 3 * parameter_bytes,
    }[config.strategy]
    if config.gpus == 1:
        comm = 0
    host_traffic = (
        2 * (grads + parameter_bytes) // max(1, config.gpus) if config.parallelism.offloads else 0
    )
    return {
        "recompute_fraction": RECOMPUTE_FRACTION if config.checkpointing else 0.0,
        "grad_accum_steps": config.grad_accum,
        "communication_bytes_per_step": comm,
        "host_transfer_bytes_per_step": host_traffic,
        "optimizer_behaviour": optimizer_changes or "unchanged",
        "numerics": NUMERICS.get(config.precision, "unchanged"),
    }


def behaviour(name: str, reference: str) -> str | None:
    """How an optimizer changes training against the plan's reference optimizer."""
    if name == reference:
        return None
    key = name.lower()
    if "8bit" in key or "4bit" in key or "fp8" in key:
        return "quantized optimizer states"
    return f"a different optimizer than {reference}"


def preference(c: Candidate) -> tuple[Any, ...]:
    """Fewest GPUs; then least harm: no recompute, fewer accumulation steps, simpler strategy,
    no offload, more headroom."""
    cfg = c.configuration
    return (
        cfg.gpus,
        cfg.checkpointing,
        cfg.grad_accum,
        cfg.parallelism.offloads,
        STRATEGY_RANK[cfg.strategy],
        -c.headroom_bytes,
    )


def pareto(candidates: list[Candidate]) -> list[Candidate]:
    """Configurations not beaten on all of GPU count, memory per GPU, recompute, communication
    and optimizer behaviour by another one."""

    def key(c: Candidate) -> tuple[float, ...]:
        k = c.costs
        return (
            c.configuration.gpus,
            c.peak_bytes_per_gpu,
            k["recompute_fraction"],
            k["communication_bytes_per_step"] + k["host_transfer_bytes_per_step"],
            0.0 if k["optimizer_behaviour"] == "unchanged" else 1.0,
            0.0 if k["numerics"] == "unchanged" else 1.0,
            k["grad_accum_steps"],
        )

    keyed = [(key(c), c) for c in candidates]
    front = []
    for ka, a in keyed:
        dominated = any(
            all(x <= y for x, y in zip(kb, ka, strict=True)) and kb != ka for kb, _ in keyed
        )
        if not dominated:
            front.append(a)
    front.sort(key=lambda c: (c.configuration.gpus, c.peak_bytes_per_gpu))
    return front
