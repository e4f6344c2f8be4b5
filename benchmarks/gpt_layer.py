"""A GPT model whose layers are what Korthikanti et al. ("Reducing Activation Recomputation in
Large Transformer Models", 2022, section 4) count: pre-LayerNorm, Q/K/V projections, eager
attention (scores, causal mask, softmax, attention dropout), output projection with dropout,
LayerNorm, a 4h MLP with GELU and dropout. Plain ``nn.Linear`` layers, so PyTorch's
tensor-parallel styles apply: ``tp_plan`` is the paper's (Megatron's) split and ``tp_sp_plan``
adds sequence parallelism (LayerNorms and dropouts on sequence shards).

FILE.py:FUNCTION references for ``benchmarks/activations.py``:
``benchmarks/gpt_layer.py:gpt``, ``:inputs``, ``:loss``, ``:tp_plan``, ``:tp_sp_plan``.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 1024
HIDDEN = int(os.environ.get("GPT_LAYER_HIDDEN", "512"))
HEADS = int(os.environ.get("GPT_LAYER_HEADS", "8"))
LAYERS = int(os.environ.get("GPT_LAYER_LAYERS", "2"))
SEQ = int(os.environ.get("GPT_LAYER_SEQ", "512"))
DROPOUT = 0.1
"""The paper counts dropout masks: dropout is on."""


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(DROPOUT)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # under tensor parallelism each rank holds heads / t of the heads (the view infers it)
        q, k, v = (
            f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.attn_drop(F.softmax(scores.masked_fill(causal, float("-inf")), dim=-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.drop(self.proj(out))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def gpt() -> GPT:
    return GPT()


def inputs(device, batch_size=1, seq_len=SEQ):
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
    return {"ids": ids, "labels": ids}


def loss(model, batch):
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


def tp_plan(model=None, mesh=None) -> dict:
    """Megatron's split: Q/K/V and the first MLP layer by columns, the output projections by
    rows; LayerNorms, dropouts and residuals replicated (the paper's sbh(10 + 24/t + 5as/(ht)))."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.layers) if model is not None else LAYERS):
        prefix = f"layers.{i}"
        for name in ("attn.q", "attn.k", "attn.v", "fc1"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "fc2"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return plan


def tp_sp_plan(model=None, mesh=None) -> dict:
    """Tensor and sequence parallelism: LayerNorms and dropouts on sequence shards, the output
    projections reduce-scatter into them (the paper's sbh(34/t + 5as/(ht)))."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # the embedding's output and the final norm on sequence shards, the logits gathered whole
    # (torchtitan's tok_embeddings / norm / output, without loss parallel)
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers) if model is not None else LAYERS):
        prefix = f"layers.{i}"
        plan[f"{prefix}.ln1"] = SequenceParallel()
        plan[f"{prefix}.ln2"] = SequenceParallel()
        plan[f"{prefix}.attn"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        for name in ("attn.q", "attn.k", "attn.v"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.attn.proj"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"{prefix}.fc1"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"{prefix}.fc2"] = RowwiseParallel(output_layouts=Shard(1))
    return plan
