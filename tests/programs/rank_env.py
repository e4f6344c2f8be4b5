"""A torchrun program that reads what torchrun gives it: its environment, the process group
``init_process_group()`` makes from it (no backend named: the default for the device), and
``torch.cuda.set_device(LOCAL_RANK)``. Rank 0 keeps a history buffer the others do not (as a
logging rank does), so its memory differs.

    torchrun --nnodes 1 --nproc-per-node 2 rank_env.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

HISTORY = 4096
"""Elements of the buffer rank 0 keeps (16 KiB of fp32)."""

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
assert local == rank % per_node and int(os.environ["GROUP_RANK"]) == rank // per_node
assert dist.is_torchelastic_launched()
torch.cuda.set_device(local)
assert torch.cuda.current_device() == local and torch.cuda.device_count() == per_node

model = DDP(nn.Linear(64, 64).cuda())
history = torch.zeros(HISTORY, device="cuda") if rank == 0 else None
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, 64, device="cuda")).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"rank {rank} (node {os.environ['GROUP_RANK']}, local rank {local}) of {world}")
dist.destroy_process_group()
