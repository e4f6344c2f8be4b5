"""A script with a bug: it raises after its first step."""

import torch
from torch import nn

model = nn.Linear(8, 8).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def check(step: int) -> None:
    if step == 1:
        raise ValueError("learning rate schedule is empty")


for step in range(3):
    loss = model(torch.randn(4, 8, device="cuda")).sum()
    loss.backward()
    optimizer.step()
    check(step)
