"""Tensor parallelism as PyTorch's "Large Scale Transformer model training with Tensor
Parallel" tutorial writes it (and pytorch/examples distributed/tensor_parallelism): a 1-D
device mesh over the ranks (``init_device_mesh``), ``parallelize_module`` on each block with
``ColwiseParallel`` on the attention's q/k/v and the feed-forward's w1/w3, ``RowwiseParallel``
on their output projections, ``SequenceParallel`` on the norms and ``PrepareModuleInput`` to
gather the sequence before attention and feed-forward; each rank's heads adjusted to its share;
then the embedding, final norm and output the same way. A foreach AdamW over the (DTensor)
parameters, a few steps of cross-entropy; each rank prints the peak
``torch.cuda.max_memory_allocated()`` reports.

    torchrun --nproc-per-node 2 tp_torchrun.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

DIM, HEADS, HIDDEN, VOCAB, LAYERS, BATCH, SEQ = 128, 4, 384, 256, 2, 4, 32


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads = HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        bsz, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q, k, v = (t.view(bsz, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def main():
    rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl")
    tp_mesh = init_device_mesh("cuda", (world_size,))
    torch.manual_seed(0)
    model = Model().to("cuda")
    model = parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        layer_tp_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        # each rank computes its share of the heads
        block.attention.n_heads = HEADS // tp_mesh.size()
        parallelize_module(module=block, device_mesh=tp_mesh, parallelize_plan=layer_tp_plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for i in range(4):
        torch.manual_seed(i)  # the same batch on every rank of the tensor-parallel group
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda")
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {dist.get_rank()} peak bytes: {torch.cuda.max_memory_allocated()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
