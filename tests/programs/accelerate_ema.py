"""An accelerate loop with an EMA copy of the model: the optimizer is made before
`accelerator.prepare` moves the model to the GPU."""

import copy

import torch
from accelerate import Accelerator
from torch import nn

torch.manual_seed(0)
accelerator = Accelerator()
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
ema = copy.deepcopy(accelerator.unwrap_model(model)).requires_grad_(False)
for _ in range(3):
    x = torch.randn(16, 64, device=accelerator.device)
    loss = (model(x) - x).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.lerp_(p, 0.01)
print("accelerate peak bytes:", torch.cuda.max_memory_allocated())
