"""PyTorch's DataParallel tutorial, as a training loop: the model wrapped in
``nn.DataParallel`` and moved with ``.cuda()`` (``nn.DataParallel(model).cuda()``), its input made
on the host and scattered by DataParallel."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.DataParallel(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 8))).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(4):
    x = torch.randn(32, 128)  # on the host: DataParallel scatters it
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("data parallel peak bytes:", torch.cuda.max_memory_allocated())
