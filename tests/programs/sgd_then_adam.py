"""The seed's snippet: how much more memory does Adam take than SGD? Train a small model with
each on the GPU and print the peak that torch.cuda.max_memory_allocated() reports."""

import torch
from torch import nn

torch.manual_seed(0)
device = "cuda"
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()


def train(optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for _ in range(steps):
        x = torch.randn(64, 256, device=device)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


torch.cuda.reset_peak_memory_stats()
train(torch.optim.SGD(model.parameters(), lr=0.01))
print("SGD peak bytes:", torch.cuda.max_memory_allocated())

torch.cuda.reset_peak_memory_stats()
train(torch.optim.Adam(model.parameters(), lr=1e-3))
print("Adam peak bytes:", torch.cuda.max_memory_allocated())
