"""The one vocabulary of memory categories and training phases.

Every breakdown vramledger produces — traced, measured, per rank, planned or rendered — uses
these names and nothing else (after PyTorch's ``_MemRefType`` in
``torch/distributed/_tools/mem_tracker.py``). Sharding adds its members here, never a second
list of strings elsewhere.
"""

from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """What a block of memory is for. Each tracked storage has exactly one category."""

    PARAMETERS = "parameters"
    """The model's parameters, in the dtype the model runs in."""
    BUFFERS = "buffers"
    """Registered module buffers (running statistics, rotary tables, position ids)."""
    INPUTS = "inputs"
    """The batch: token ids, labels, pixel values."""
    GRADIENTS = "gradients"
    """``param.grad`` of the model parameters (and of master weights in mixed precision)."""
    MASTER_WEIGHTS = "master_weights"
    """fp32 copies of half-precision parameters kept for the optimizer (DeepSpeed/Megatron style)."""
    OPTIMIZER_STATE = "optimizer_state"
    """Tensors in ``optimizer.state``: momentum, Adam's m and v, quantized codes and scales, step."""
    ACTIVATIONS = "activations"
    """Tensors made during forward (or its recomputation) still alive when it ends: saved for backward."""
    TEMPORARIES = "temporaries"
    """Everything else: forward intermediates freed before backward, gradients of activations,
    ``optimizer.step()`` scratch tensors, the loss scaler's bookkeeping."""
    WORKSPACE = "workspace"
    """Scratch memory a library takes from the framework's allocator outside any tensor
    (the cuBLAS workspace on CUDA)."""
    # -- added by data-parallel sharding (parallel/) --
    SHARDED_PARAMETERS = "sharded_parameters"
    """This rank's shard of the parameters (FSDP / ZeRO-2/3); with mixed precision, the fp32 shard
    that the optimizer steps."""
    SHARDED_GRADIENTS = "sharded_gradients"
    """This rank's shard of the gradients, after reduce-scatter."""
    ALL_GATHER_BUFFERS = "all_gather_buffers"
    """Buffers that gather a layer's parameter shards from every rank."""
    REDUCE_SCATTER_BUFFERS = "reduce_scatter_buffers"
    """Buffers that reduce a layer's gradients and scatter the shards."""
    GRADIENT_BUCKETS = "gradient_buckets"
    """DDP's flat buffers that gradients are copied into for all-reduce."""
    # -- added by tensor, sequence, context and expert parallelism (parallel/mesh.py) --
    COMM_BUFFERS = "comm_buffers"
    """Outputs of the collectives that move activations between ranks (tensor/sequence-parallel
    all-gathers and reduce-scatters, loss-parallel all-reduces, context-parallel exchanges,
    expert all-to-all) that are not saved for backward: those are activations."""
    # -- added by pipeline parallelism (parallel/pipeline.py) --
    PIPELINE_BUFFERS = "pipeline_buffers"
    """A pipeline stage's receive buffers (torch.distributed.pipelining): one per micro-batch for
    the activations from the previous stage (the stage's input, kept for its backward) and one
    per micro-batch for the gradients from the next stage, made when the schedule first runs
    and kept."""

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Category.PARAMETERS: "model parameters",
    Category.BUFFERS: "module buffers",
    Category.INPUTS: "the input batch",
    Category.GRADIENTS: "parameter gradients",
    Category.MASTER_WEIGHTS: "fp32 master weights",
    Category.OPTIMIZER_STATE: "optimizer state",
    Category.ACTIVATIONS: "activations saved for backward",
    Category.TEMPORARIES: "temporaries (intermediates, grads of activations, step scratch)",
    Category.WORKSPACE: "library workspace (cuBLAS)",
    Category.SHARDED_PARAMETERS: "this rank's parameter shards",
    Category.SHARDED_GRADIENTS: "this rank's gradient shards",
    Category.ALL_GATHER_BUFFERS: "all-gather buffers",
    Category.REDUCE_SCATTER_BUFFERS: "reduce-scatter buffers",
    Category.GRADIENT_BUCKETS: "DDP gradient buckets",
    Category.COMM_BUFFERS: "activation collectives (TP/SP, CP, EP)",
    Category.PIPELINE_BUFFERS: "pipeline receive buffers (activations, gradients)",
}

# When one storage qualifies for several categories (a parameter is also saved for backward by
# the matmul that reads it), the earliest in this order wins.
CATEGORY_PRIORITY: tuple[Category, ...] = (
    Category.PARAMETERS,
    Category.SHARDED_PARAMETERS,
    Category.BUFFERS,
    Category.INPUTS,
    Category.MASTER_WEIGHTS,
    Category.OPTIMIZER_STATE,
    Category.SHARDED_GRADIENTS,
    Category.GRADIENTS,
    Category.GRADIENT_BUCKETS,
    Category.ALL_GATHER_BUFFERS,
    Category.REDUCE_SCATTER_BUFFERS,
    Category.WORKSPACE,
    Category.PIPELINE_BUFFERS,
    Category.ACTIVATIONS,
    Category.COMM_BUFFERS,
    Category.TEMPORARIES,
)
CATEGORY_RANK: dict[Category, int] = {c: i for i, c in enumerate(CATEGORY_PRIORITY)}

# Model states in the ZeRO paper's sense (Rajbhandari et al. 2020, section 3.1).
MODEL_STATE_CATEGORIES: tuple[Category, ...] = (
    Category.PARAMETERS,
    Category.SHARDED_PARAMETERS,
    Category.GRADIENTS,
    Category.SHARDED_GRADIENTS,
    Category.MASTER_WEIGHTS,
    Category.OPTIMIZER_STATE,
)


class Phase(str, Enum):
    """Where in a training step an allocation happens."""

    SETUP = "setup"
    """Before the first step: model, inputs, master weights."""
    FORWARD = "forward"
    """Forward pass and loss."""
    BACKWARD = "backward"
    """``loss.backward()``, including recomputation under activation checkpointing."""
    OPTIMIZER = "optimizer"
    """``zero_grad``, gradient unscaling and master-weight copies, and ``optimizer.step()``."""


STEP_PHASES: tuple[Phase, ...] = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
