"""A loop that logs its loss with .item() and a formatted print."""

import torch
from torch import nn

model = nn.Linear(16, 4).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
targets = torch.tensor([0, 1, 2, 3]).cuda()
for step in range(3):
    logits = model(torch.randn(4, 16, device="cuda"))
    loss = nn.functional.cross_entropy(logits, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}")
print("tokens:", int((targets >= 0).sum()))
