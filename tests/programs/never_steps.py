"""A script that never calls optimizer.step(): it evaluates forever."""

import torch
from torch import nn

model = nn.Linear(32, 32).cuda()
with torch.no_grad():
    while True:
        out = model(torch.randn(16, 32, device="cuda"))
