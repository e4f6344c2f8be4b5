"""PyTorch's "Getting Started with Distributed Data Parallel", its torchrun example
(``elastic_ddp.py``), with a larger toy model, AdamW and a few steps; each rank prints the peak
``torch.cuda.max_memory_allocated()`` reports.

    torchrun --nproc-per-node 2 ddp_torchrun.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(256, 512)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(512, 128)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    # create model and move it to GPU with id rank
    device_id = rank % torch.cuda.device_count()
    model = ToyModel().to(device_id)
    ddp_model = DDP(model, device_ids=[device_id])

    loss_fn = nn.MSELoss()
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=0.001)

    for _ in range(4):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 256))
        labels = torch.randn(20, 128).to(device_id)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    print(f"rank {rank} peak bytes: {torch.cuda.max_memory_allocated()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    demo_basic()
