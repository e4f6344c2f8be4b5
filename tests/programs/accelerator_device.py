"""A training loop that picks its device as PyTorch's own examples do (pytorch/examples,
mnist/main.py: ``torch.accelerator.current_accelerator()`` when
``torch.accelerator.is_available()``), and reads its peak from ``torch.accelerator.memory``."""

import torch
from torch import nn

use_accel = torch.accelerator.is_available()
device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")
print("device:", device, torch.accelerator.device_count())
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(4):
    x = torch.randn(64, 256, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    torch.accelerator.synchronize()
print("accelerator peak bytes:", torch.accelerator.max_memory_allocated())
