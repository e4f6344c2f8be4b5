"""FSDP2 as PyTorch's "Getting Started with Fully Sharded Data Parallel (FSDP2)" writes it:
``fully_shard`` on each transformer-style block, then on the root, the optimizer over the
sharded (DTensor) parameters, a few steps; each rank prints the peak
``torch.cuda.max_memory_allocated()`` reports.

    torchrun --nproc-per-node 2 fsdp2_torchrun.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

DIM, VOCAB, LAYERS, BATCH, SEQ = 128, 256, 4, 4, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main():
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl")
    torch.manual_seed(0)
    model = Model().to(device)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(4):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
    print(f"rank {dist.get_rank()} peak bytes: {torch.cuda.max_memory_allocated()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
