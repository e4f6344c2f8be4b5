"""Training with an exponential moving average (EMA) copy of the weights, updated after each
step and used for evaluation."""

import copy

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)).cuda()
ema = copy.deepcopy(model).requires_grad_(False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
decay = 0.99

for _step in range(4):
    x = torch.randn(32, 128).cuda()
    loss = (model(x) - x).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.lerp_(p, 1 - decay)
        eval_loss = (ema(x) - x).pow(2).mean()

print("EMA peak bytes:", torch.cuda.max_memory_allocated())
