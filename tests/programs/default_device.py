"""A model built with `torch.set_default_device("cuda")`, and one built on the meta device and
then materialised on the GPU with `to_empty`."""

import torch
from torch import nn

torch.manual_seed(0)
torch.set_default_device("cuda")
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
x = torch.randn(8, 32)
torch.set_default_device("cpu")
with torch.device("meta"):
    head = nn.Linear(32, 16)
head.to_empty(device="cuda")
optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
for _ in range(3):
    head(model(x)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print("default-device peak bytes:", torch.cuda.max_memory_allocated())
