"""TrainingSpec: everything that decides the memory of a training step, as one typed value.

The Python API (``estimate(spec)``, ``measure(spec)``) and the CLI take the same fields; each CLI
option is named after the field it sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .errors import InputError
from .precision import PRECISIONS, Precision
from .tasks import TASKS

ROUTINGS: tuple[str, ...] = ("balanced", "first", "last", "worst")

Strategy = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp"]
STRATEGIES: tuple[str, ...] = Strategy.__args__  # type: ignore[attr-defined]
"""How ranks share the work (``parallel/strategy.py`` says what each keeps on a rank)."""
Offload = Literal["none", "optimizer", "params", "both"]
OFFLOADS: tuple[str, ...] = Offload.__args__  # type: ignore[attr-defined]
"""What is kept in host memory."""
"""MoE routing policies (trace/values.py answers router choices by them)."""

Target = Literal["cuda", "cpu"]
TARGETS: tuple[str, ...] = ("cuda", "cpu")


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    model: Any
    """A config.json or its folder, ``FILE.py:FUNCTION``, ``package.module:FUNCTION``, or from
    Python an ``nn.Module``, a zero-argument callable returning one, or a transformers config."""
    task: str | None = None
    """Hugging Face task: causal-lm, masked-lm, seq2seq-lm, image-classification,
    sequence-classification. Read from the config's ``architectures`` when not given."""
    batch_size: int = 1
    """Micro-batch size (examples per forward)."""
    seq_len: int = 512
    """Tokens per example for text models."""
    image_size: int | None = None
    """Image side in pixels for vision models (default: the config's image_size)."""
    inputs: Any = None
    """``FILE.py:FUNCTION`` making a batch, called with ``device=`` and, where its signature takes
    them, ``batch_size=``, ``seq_len=``, ``image_size=``; returns a dict, tuple or tensor."""
    loss: Any = None
    """``FILE.py:FUNCTION`` called as ``loss(model, batch)`` returning the scalar loss (runs the
    forward itself). Default: the model's ``output.loss``."""
    optimizer: Any = "adamw"
    """A torch.optim name (adamw, sgd, sgd-momentum, adam, adagrad, rmsprop, ...) or a class
    (import path or, from Python, the class itself)."""
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the optimizer (momentum, foreach, fused, amsgrad, ...)."""
    precision: Precision = "fp32"
    """fp32, bf16-autocast, fp16-autocast, bf16-mixed, fp16-mixed or bf16-pure."""
    grad_checkpointing: bool = False
    """Activation checkpointing through the Hugging Face model's own switch."""
    checkpoint_modules: tuple[str, ...] = ()
    """Checkpoint every submodule of these class names (any model)."""
    grad_accum: int = 1
    """Micro-steps (forward + backward) per optimizer step."""
    steps: int = 2
    """Training steps to run; the first creates optimizer state, later ones are steady state."""
    target: Target = "cuda"
    """Device whose behaviour to predict: cuda (the default, even on a CPU-only machine) or cpu."""
    seed: int = 0
    """Seed for real runs (weights and synthetic batches)."""
    world_size: int = 1
    """Data-parallel ranks (GPUs) the step is spread over."""
    strategy: str | None = None
    """ddp, zero1, zero2, zero3 or fsdp (default: none on one rank, ddp on several)."""
    offload: str = "none"
    """Keep in host memory: optimizer (state, fp32 masters and their gradients), params
    (sharded parameters), both, or none."""
    nodes: int | None = None
    """Machines; with gpus_per_node, sets world_size."""
    gpus_per_node: int | None = None
    """GPUs per machine; with nodes, sets world_size."""
    deepspeed: str | None = None
    """A DeepSpeed JSON config: ZeRO stage, offload, bf16/fp16, micro-batch and gradient
    accumulation are read from it."""
    moe_routing: str = "balanced"
    """How a mixture-of-experts router's choices are answered in a trace (its values depend on
    the weights): balanced (every expert the same number of tokens) or worst (the last k experts
    take every token; an upper bound for a loop over experts). See trace/values.py."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InputError(
                    f"{name.replace('_', '-')} must be a positive integer, not {value!r}"
                )
        if self.image_size is not None and (
            not isinstance(self.image_size, int) or self.image_size <= 0
        ):
            raise InputError(f"image-size must be a positive integer, not {self.image_size!r}")
        if not isinstance(self.steps, int) or self.steps < 2:
            raise InputError(
                f"steps must be at least 2, not {self.steps!r}",
                hint="step 1 creates the optimizer state; the steady state starts at step 2",
            )
        if self.precision not in PRECISIONS:
            raise InputError(
                f"unknown precision {self.precision!r}", hint=f"use one of {', '.join(PRECISIONS)}"
            )
        if self.target not in TARGETS:
            raise InputError(f"unknown target {self.target!r}", hint="use cuda or cpu")
        if self.task is not None and self.task not in TASKS:
            raise InputError(f"unknown task {self.task!r}", hint=f"use one of {', '.join(TASKS)}")
        if not isinstance(self.optimizer_kwargs, dict):
            raise InputError(
                f"optimizer kwargs must be a JSON object, not {type(self.optimizer_kwargs).__name__}",
                hint="write it like '{\"momentum\": 0.9}'",
            )
        if self.moe_routing not in ROUTINGS:
            raise InputError(
                f"unknown MoE routing {self.moe_routing!r}", hint=f"use {' or '.join(ROUTINGS)}"
            )
        object.__setattr__(self, "checkpoint_modules", tuple(self.checkpoint_modules))
        self._check_parallel()

    def _check_parallel(self) -> None:
        for name in ("world_size", "nodes", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise InputError(
                    f"{name.replace('_', '-')} must be a positive integer, not {value!r}"
                )
        if (self.nodes is None) != (self.gpus_per_node is None):
            raise InputError(
                "give --nodes and --gpus-per-node together", hint="or just --world-size"
            )
        if self.nodes is not None and self.gpus_per_node is not None:
            world = self.nodes * self.gpus_per_node
            if self.world_size not in (1, world):
                raise InputError(
                    f"world-size {self.world_size} is not nodes x gpus-per-node = {world}"
                )
            object.__setattr__(self, "world_size", world)
        strategy = self.strategy or ("ddp" if self.world_size > 1 else "none")
        if strategy not in STRATEGIES:
            raise InputError(
                f"unknown strategy {strategy!r}", hint=f"use one of {', '.join(STRATEGIES[1:])}"
            )
        if strategy == "none" and self.world_size > 1:
            raise InputError(
                f"world-size {self.world_size} needs a --strategy",
                hint="ddp, zero1, zero2, zero3 or fsdp",
            )
        object.__setattr__(self, "strategy", strategy)
        if self.offload not in OFFLOADS:
            raise InputError(
                f"unknown offload {self.offload!r}", hint=f"use one of {', '.join(OFFLOADS)}"
            )

    def summary(self) -> dict[str, Any]:
        """The spec as plain JSON-ready values (code objects by name)."""
        out = {}
        for f in fields(self):
            key, value = f.name, getattr(self, f.name)
            if key == "model" and not isinstance(value, (str, int, float, type(None))):
                value = getattr(value, "__name__", type(value).__name__)
            elif key in ("inputs", "loss", "optimizer") and callable(value):
                value = getattr(value, "__name__", repr(value))
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            out[key] = value
        return out
