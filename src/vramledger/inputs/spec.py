"""TrainingSpec: everything that decides the memory of a training step, as one typed value.

The Python API (``estimate(spec)``, ``measure(spec)``) and the CLI take the same fields; each CLI
option is named after the field it sets and made from it (its docstring, default, choices and
the ``cli(...)`` metadata of spec_fields.py) by cli/options.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from vramledger.inputs.adapters import QUANTIZE, parse_lora
from vramledger.inputs.attention import IMPLEMENTATIONS, check_implementation
from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import CATALOGUE, Gpu, asked_gpu
from vramledger.inputs.parallelism import (  # noqa: F401 (re-exported)
    MAX_RANKS,
    OFFLOADS,
    STRATEGIES,
    Offload,
    Parallelism,
    Strategy,
)
from vramledger.inputs.precision import PRECISIONS, Precision, canonical_precision
from vramledger.inputs.spec_fields import (
    CODE,
    bool_or_int,
    cli,
    comma_names,
    json_object,
    option_flag,
)
from vramledger.inputs.tasks import TASKS
from vramledger.inputs.verdict import DEFAULT_MARGIN, check_gpu_options

ROUTINGS: tuple[str, ...] = ("balanced", "first", "last", "worst")
"""MoE routing policies (trace/core/values.py answers router choices by them)."""

PpSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
PP_SCHEDULES: tuple[str, ...] = PpSchedule.__args__  # type: ignore[attr-defined]
"""torch.distributed.pipelining schedules: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B."""
Target = Literal["cuda", "cpu"]
TARGETS: tuple[str, ...] = ("cuda", "cpu")


MAX_SEQ_LEN = 2**24
"""16,777,216 tokens: above the longest context any released model was trained for (Llama 4
Scout, 10M tokens, 2025) and 4x the longest `vramledger fit` searches (plan/fit.py MAX_SEQ); a
longer sequence is a typo, and the default batch is made for real on the host before the trace
(``--seq-len 1000000000`` held 16 GB and traced for a minute before it failed)."""


def _optimizer_names() -> list[str]:
    """The optimizer names ``--optimizer`` knows (imports torch.optim: asked only by the page)."""
    from vramledger.inputs.optimizers import known_names

    return known_names()


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """Everything that decides the memory of a training step. Each field's docstring is its
    description for the Python API and the command line's ``--help`` alike (spec_fields.py)."""

    model: Any = field(metadata=cli("model"))
    """A config.json or its folder, ``FILE.py:FUNCTION``, ``package.module:FUNCTION``, or from
    Python an ``nn.Module``, a zero-argument callable returning one, or a transformers config."""
    task: str | None = field(default=None, metadata=cli("model", choices=TASKS))
    """Hugging Face task (tasks.py). Read from the config's ``architectures`` when not given."""
    batch_size: int = field(default=1, metadata=cli("model"))
    """Micro-batch size (examples per forward)."""
    seq_len: int = field(default=512, metadata=cli("model"))
    """Tokens per example for text models."""
    image_size: int | None = field(default=None, metadata=cli("model"))
    """Image side in pixels for vision models (default: the config's image_size)."""
    inputs: Any = field(default=None, metadata=cli("model", metavar=CODE))
    """``FILE.py:FUNCTION`` making a batch, called with ``device=`` and, where its signature takes
    them, ``batch_size=``, ``seq_len=``, ``image_size=``; returns a dict, tuple or tensor."""
    loss: Any = field(default=None, metadata=cli("model", metavar=CODE))
    """``FILE.py:FUNCTION`` called as ``loss(model, batch)`` returning the scalar loss (runs the
    forward itself). Default: the model's ``output.loss``."""
    optimizer: Any = field(default="adamw", metadata=cli("optimizer", offered=_optimizer_names))
    """A torch.optim name (adamw, sgd, sgd-momentum, adam, adagrad, rmsprop, ...) or a class
    (import path or, from Python, the class itself)."""
    optimizer_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata=cli("optimizer", metavar="JSON", convert=json_object)
    )
    """Keyword arguments for the optimizer (momentum, foreach, fused, amsgrad, ...), on the
    command line as a JSON object."""
    precision: Precision = field(
        default="fp32",
        metadata=cli(
            "precision", metavar="{" + ",".join(PRECISIONS) + "}", offered=lambda: PRECISIONS
        ),
    )
    """The frameworks' names (precision.py): fp32 (or 32-true), bf16-mixed and 16-mixed
    (autocast over fp32 weights, as Lightning, HF Trainer and accelerate), bf16-true (bf16
    weights), bf16-master and fp16-master (half weights with an fp32 master copy, as DeepSpeed)."""
    grad_checkpointing: bool = field(default=False, metadata=cli("precision"))
    """Activation checkpointing through the Hugging Face model's own switch."""
    checkpoint_modules: tuple[str, ...] = field(
        default=(), metadata=cli("precision", metavar="CLASSNAME", convert=comma_names)
    )
    """Checkpoint every submodule of these class names (any model); the option repeats, or
    takes the names separated by commas."""
    grad_accum: int = field(default=1, metadata=cli("step"))
    """Micro-steps (forward + backward) per optimizer step."""
    steps: int = field(default=2, metadata=cli("step"))
    """Training steps to run; the first creates optimizer state, later ones are steady state."""
    target: Target = field(default="cuda", metadata=cli("step", choices=TARGETS))
    """Device whose behaviour to predict: cuda (even on a CPU-only machine) or cpu."""
    seed: int = field(default=0, metadata=cli("step"))
    """Seed for real runs (weights and synthetic batches)."""
    world_size: int = field(default=1, metadata=cli("parallelism"))
    """Ranks (GPUs) the step is spread over: data-parallel x tp x pp x cp."""
    strategy: str | None = field(default=None, metadata=cli("parallelism", choices=STRATEGIES[1:]))
    """ddp, zero1, zero2, zero3 (DeepSpeed's engine and its ZeRO stages), fsdp (FSDP2),
    zero1-torch (PyTorch's ZeroRedundancyOptimizer), or zero0 (DeepSpeed's engine without ZeRO:
    what a --deepspeed config of stage 0 runs) (default: none on one rank, ddp on several, fsdp
    when the model is split)."""
    offload: str = field(default="none", metadata=cli("parallelism", choices=OFFLOADS))
    """Keep in host memory: optimizer (state, fp32 masters and their gradients), params
    (sharded parameters), both, or none."""
    nodes: int | None = field(default=None, metadata=cli("parallelism"))
    """Machines; with gpus_per_node, sets world_size."""
    gpus_per_node: int | None = field(default=None, metadata=cli("parallelism"))
    """GPUs per machine; with nodes, sets world_size."""
    deepspeed: str | None = field(
        default=None, metadata=cli("parallelism", metavar="ds_config.json")
    )
    """A DeepSpeed JSON config: ZeRO stage, offload, bf16/fp16, micro-batch and gradient
    accumulation are read from it."""
    shard_modules: tuple[str, ...] = field(
        default=(), metadata=cli("parallelism", metavar="CLASSNAME", convert=comma_names)
    )
    """FSDP units (fsdp): fully_shard every submodule that is an instance of a class of
    these names, children before parents, then the root (default: each block of the model's
    stack of identical blocks, then the root; the option repeats, or takes the names separated
    by commas). See parallel/fsdp_units.py."""
    shard_min_params: int | None = field(default=None, metadata=cli("parallelism", metavar="N"))
    """FSDP units by size (accelerate's SIZE_BASED_WRAP): every submodule other than the root
    holding more than this many parameters, its submodules' included."""
    reshard_after_forward: bool | int | None = field(
        default=None, metadata=cli("parallelism", metavar="true|false|N", parse=bool_or_int)
    )
    """FSDP2's ``reshard_after_forward`` for each unit: True frees gathered parameters after a
    unit's forward and gathers them again in backward, False keeps them, an int N keeps a copy
    sharded over N ranks (a divisor of world_size). Default (None): FSDP2's own, True for the
    units; the root always keeps FSDP2's default (False)."""
    accelerate_config: str | None = field(
        default=None, metadata=cli("parallelism", metavar="FILE.yaml")
    )
    """An accelerate config (YAML or JSON, as ``accelerate config`` writes it): distributed
    type, FSDP2 wrap policy, offload, reshard_after_forward, activation checkpointing, mixed
    precision and process count are read from it, and the model is wrapped as accelerate does
    (accelerate_config.py)."""
    configs_applied: bool = False
    """Set once the ``deepspeed`` and ``accelerate_config`` files are read into the other fields
    (``launch_configs.apply_configs``): what is made from this spec afterwards (fit's sizes,
    plan's strategies and GPU counts, advise's changes) keeps its own values, not the files'.
    Not a command-line option."""
    dp_shard: int | None = field(default=None, metadata=cli("parallelism", metavar="N"))
    """Ranks the data-parallel axis shards over (FSDP2 / ZeRO-3) when the model is also split
    along other axes; default: the world size divided by tp x pp x cp."""
    tp: int = field(default=1, metadata=cli("parallelism", metavar="N"))
    """Tensor-parallel degree: each layer's matrices split over this many ranks (with sequence
    parallelism for the norms and dropout between them); within a node."""
    pp: int = field(default=1, metadata=cli("parallelism", metavar="N"))
    """Pipeline-parallel degree: the layers split into this many stages
    (torch.distributed.pipelining), each stage on its own ranks."""
    pp_schedule: str = field(default="1f1b", metadata=cli("parallelism", choices=PP_SCHEDULES))
    """gpipe, 1f1b or interleaved-1f1b: the order the pipeline runs its micro-batches in, which
    decides how many micro-batches' activations a stage holds at once."""
    microbatches: int | None = field(default=None, metadata=cli("parallelism", metavar="N"))
    """Micro-batches per pipeline step (each of ``batch_size`` examples); default: pp."""
    cp: int = field(default=1, metadata=cli("parallelism", metavar="N"))
    """Context-parallel degree: the sequence split over this many ranks in attention."""
    ep: int = field(default=1, metadata=cli("parallelism", metavar="N"))
    """Expert-parallel degree for mixture-of-experts layers: the experts split over this many
    ranks of the data-parallel (and context-parallel) axes, tokens exchanged all-to-all."""
    tp_plan: str | None = field(default=None, metadata=cli("parallelism", metavar=CODE))
    """``FILE.py:FUNCTION`` returning the tensor-parallel plan for the model (a dict of module
    name pattern -> torch.distributed.tensor.parallel style); default: the model family's."""
    moe_routing: str = field(default="balanced", metadata=cli("model", choices=ROUTINGS))
    """How a mixture-of-experts router's choices are answered in a trace (its values depend on
    the weights): balanced (every expert the same number of tokens), first / last (every expert
    runs, the first / last k take the other tokens) or worst (the largest of the three). Only
    traced when a value-dependent operator reads the routing. See trace/core/values.py."""
    lora: str | None = field(
        default=None, metadata=cli("adapters", metavar="r=R,alpha=A,targets=M1,M2[,dropout=P]")
    )
    """LoRA adapters through peft: ``r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05]`` or
    ``targets=all-linear``; the base is frozen (adapters.py)."""
    quantize: str | None = field(default=None, metadata=cli("adapters", choices=QUANTIZE))
    """Quantized base weights through bitsandbytes: nf4 or fp4 (QLoRA, double quantization) or
    int8 (LLM.int8)."""
    attn_implementation: str | None = field(
        default=None, metadata=cli("model", choices=IMPLEMENTATIONS)
    )
    """The attention path of a Hugging Face model: sdpa (transformers' default), eager, or
    flash_attention_2 (modelled, attention.py). Default: the model's own."""
    freeze: tuple[str, ...] = field(default=(), metadata=cli("adapters", metavar="PATTERN"))
    """Freeze parameters whose names match these fnmatch patterns (the option repeats)."""
    gpu: str | Gpu | None = field(
        default=None, metadata=cli("gpu", metavar="NAME", offered=lambda: tuple(CATALOGUE))
    )
    """The GPU to predict, from the catalogue (gpus.py: a100-80gb, h100-80gb, v100-32gb, ...;
    from Python also a ``Gpu``): its compute capability selects CUDA's decisions in the trace
    (cuBLAS workspace, attention kernel) and the ledger says whether the step fits its memory.
    Default: none (compute capability 9.0 assumed, no verdict)."""
    gpu_memory: str | int | None = field(default=None, metadata=cli("gpu", metavar="SIZE"))
    """Memory of a GPU not in the catalogue ('24GiB', '80GB', or bytes from Python): a verdict
    against it, compute capability 9.0 assumed; with ``gpu``, that GPU with this memory."""
    margin: str | int | None = field(default=None, metadata=cli("gpu", metavar="SIZE"))
    """Memory kept back from the GPU's for what no trace sees (CUDA context, NCCL buffers,
    fragmentation): '2GiB', or bytes from Python. Default 2 GiB (verdict.py)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InputError(
                    f"{name.replace('_', '-')} must be a positive integer, not {value!r}"
                )
        if self.seq_len > MAX_SEQ_LEN:
            raise InputError(
                f"seq-len {self.seq_len:,} is beyond any model's context (vramledger models at "
                f"most {MAX_SEQ_LEN:,} tokens)",
                hint="check the number",
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
        # the frameworks' aliases resolved; old vramledger spellings refused with the new name
        object.__setattr__(self, "precision", canonical_precision(self.precision))
        if self.target not in TARGETS:
            raise InputError(f"unknown target {self.target!r}", hint="use cuda or cpu")
        if self.task is not None and self.task not in TASKS:
            raise InputError(f"unknown task {self.task!r}", hint=f"use one of {', '.join(TASKS)}")
        if not isinstance(self.optimizer_kwargs, dict):
            raise InputError(
                f"optimizer kwargs must be a JSON object, not {type(self.optimizer_kwargs).__name__}",
                hint="write it like '{\"momentum\": 0.9}'",
            )
        check_implementation(self.attn_implementation)
        if self.moe_routing not in ROUTINGS:
            raise InputError(
                f"unknown MoE routing {self.moe_routing!r}", hint=f"use {' or '.join(ROUTINGS)}"
            )
        object.__setattr__(self, "checkpoint_modules", tuple(self.checkpoint_modules))
        object.__setattr__(self, "freeze", tuple(self.freeze))
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise InputError(
                f"unknown --quantize {self.quantize!r}", hint=f"use {', '.join(QUANTIZE)}"
            )
        if self.lora is not None:
            parse_lora(self.lora)  # a malformed --lora is refused before anything is built
        self._check_gpu()
        units = self.shard_modules
        object.__setattr__(
            self, "shard_modules", (units,) if isinstance(units, str) else tuple(units)
        )
        self._check_parallel()

    def _check_parallel(self) -> None:
        """The parallel section checked and resolved once by its class (the world size made
        from the axes or the nodes, the default strategy), and the pipeline's schedule."""
        parallelism = Parallelism.resolve(
            strategy=self.strategy,
            world_size=self.world_size,
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            dp_shard=self.dp_shard,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            offload=self.offload,
        )
        object.__setattr__(self, "world_size", parallelism.world_size)
        object.__setattr__(self, "strategy", parallelism.strategy)
        object.__setattr__(self, "_parallelism", parallelism)
        if self.microbatches is not None and (
            not isinstance(self.microbatches, int)
            or isinstance(self.microbatches, bool)
            or self.microbatches <= 0
        ):
            raise InputError(f"microbatches must be a positive integer, not {self.microbatches!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise InputError(
                f"unknown pipeline schedule {self.pp_schedule!r}",
                hint=f"use {', '.join(PP_SCHEDULES)}",
            )
        if self.microbatches is not None and self.pp == 1:
            raise InputError("--microbatches is for pipeline parallelism", hint="add --pp N")
        self._check_shard_units()

    @property
    def parallelism(self) -> Parallelism:
        """The strategy and the parallel axes as one value to ask (``parallelism.py``), as
        resolved when the spec was made."""
        return self._parallelism  # type: ignore[attr-defined]

    @property
    def model_split(self) -> int:
        """Ranks one copy of the model is split over: tp x pp x cp."""
        return self.parallelism.model_split

    @property
    def dp_degree(self) -> int:
        """Ranks of the data-parallel axis (replicas or FSDP shards)."""
        return self.parallelism.data_parallel_degree

    def _check_shard_units(self) -> None:
        given = [
            option_flag(name)
            for name in ("shard_modules", "shard_min_params", "reshard_after_forward")
            if getattr(self, name) not in ((), None)
        ]
        if not given:
            return
        if not self.parallelism.is_fsdp and self.accelerate_config is None:
            raise InputError(
                f"{' and '.join(given)} set FSDP units, and the strategy is {self.strategy}",
                hint="add --strategy fsdp (FSDP2)",
            )
        if self.shard_modules and self.shard_min_params is not None:
            raise InputError(
                "give FSDP units by class (--shard-modules) or by size (--shard-min-params), not both"
            )
        n = self.shard_min_params
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise InputError(f"shard-min-params must be a non-negative integer, not {n!r}")
        r = self.reshard_after_forward
        if (
            r is not None
            and not isinstance(r, bool)
            and (not isinstance(r, int) or r < 1 or self.world_size % r)
        ):
            raise InputError(
                f"reshard-after-forward {r!r} is not true, false or a divisor of the world "
                f"size {self.world_size}",
                hint="an integer N keeps each unit's parameters sharded over N ranks after forward",
            )

    def _check_gpu(self) -> None:
        """Sizes to bytes; a GPU needs the CUDA target, a modelled (NVIDIA) kind and a margin
        that leaves some of its memory (``verdict.check_gpu_options``)."""
        margin = check_gpu_options(self.target, self.gpu, self.gpu_memory, self.margin)
        object.__setattr__(self, "margin", margin)

    def gpu_kind(self) -> Gpu | None:
        """The GPU the step is predicted for (``gpu``/``gpu_memory``), None when not given."""
        return asked_gpu(self.gpu, self.gpu_memory)

    @property
    def margin_bytes(self) -> int:
        return DEFAULT_MARGIN if self.margin is None else int(self.margin)

    def summary(self) -> dict[str, Any]:
        """The spec as plain JSON-ready values (code objects by name)."""
        out = {}
        for f in fields(self):
            key, value = f.name, getattr(self, f.name)
            if key == "model" and not isinstance(value, (str, int, float, type(None))):
                value = getattr(value, "__name__", type(value).__name__)
            elif key in ("inputs", "loss", "optimizer") and callable(value):
                value = getattr(value, "__name__", repr(value))
            elif isinstance(value, Gpu):
                value = value.name
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            out[key] = value
        return out
