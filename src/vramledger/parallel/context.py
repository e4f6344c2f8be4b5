"""Context parallelism: the sequence split over ``cp`` ranks, attention exchanged between them.

Run by PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` (as torchtitan
does): inside it the batch's sequence-dimension buffers are sharded in place (with its default
head-tail load balancing, which needs the sequence to divide by ``2 x cp``), and
``scaled_dot_product_attention`` becomes ring attention: each rank's queries against every
rank's keys and values, gathered once per call (``_AllGatherRotater``, its default rotate
method) and merged in fp32 (``_SDPAMerger``, ``convert_to_f32``).

Ring attention is implemented only around CUDA's fused kernels (flash, memory-efficient,
cuDNN; ``_sdpa_handler`` raises "CP only supports flash attention and memory efficient
attention now" for any other): a CUDA estimate traces it (the trace calls the CUDA kernel a GPU
would pick, ``trace/emulation/sdpa_cuda.py``, and CP's handler runs the ring around it on fake tensors);
a CPU target, and so a real gloo run on CPU, cannot run it.

A Hugging Face decoder derives its positions from the length it sees, which under CP is the
local part: the batch is given global ``position_ids`` (sharded with the rest), as torchtitan
shards its rotary table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vramledger.inputs.errors import InputError

SEQ_BUFFERS = ("input_ids", "labels", "position_ids", "attention_mask", "token_type_ids")
"""Batch entries whose dimension 1 is the sequence."""
LOAD_BALANCE_FACTOR = 2
"""Head-tail load balancing cuts the sequence into 2 x cp chunks (``_HeadTailLoadBalancer``;
torchtitan's ``seq_len_divisor``)."""


def check_context_parallel(seq_len: int, cp: int, target: str) -> None:
    """What PyTorch's context parallelism needs: a CUDA target and a sequence that divides into
    ``2 x cp`` chunks."""
    if target != "cuda":
        raise InputError(
            "context parallelism runs only on CUDA attention kernels (PyTorch's ring attention "
            "wraps flash, memory-efficient and cuDNN attention)",
            hint="estimate it for --target cuda; a CPU run cannot use it",
        )
    if seq_len % (LOAD_BALANCE_FACTOR * cp):
        raise InputError(
            f"seq-len {seq_len} does not divide into 2 x cp = {LOAD_BALANCE_FACTOR * cp} chunks "
            "(context parallelism's head-tail load balancing)",
            hint=f"use a multiple of {LOAD_BALANCE_FACTOR * cp}",
        )


def sequence_buffers(batch: Any, seq_len: int) -> list[torch.Tensor]:
    """The batch's tensors that run along the sequence, a global ``position_ids`` added to a
    dict batch that has none (so positions stay global once the sequence is split)."""
    if not isinstance(batch, dict):
        raise InputError(
            "context parallelism needs a dict batch (input_ids, labels, ...) to split along "
            "the sequence"
        )
    ids = batch.get("input_ids")
    if "position_ids" not in batch and isinstance(ids, torch.Tensor):
        positions = torch.arange(seq_len, device=ids.device)
        batch["position_ids"] = positions.repeat(ids.shape[0], 1)  # resized in place: not a view
    return [
        t for name in SEQ_BUFFERS if isinstance(t := batch.get(name), torch.Tensor) and t.dim() >= 2
    ]


@contextlib.contextmanager
def context_parallel_step(cp_mesh: Any, batch: Any, seq_len: int) -> Iterator[None]:
    """PyTorch's ``context_parallel`` over ``cp_mesh`` with the batch's sequence buffers
    (sharded in place, restored after)."""
    from torch.distributed.tensor.experimental import context_parallel

    buffers = sequence_buffers(batch, seq_len)
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
        yield
