"""A loop that saves a checkpoint after training."""

import os
import sys
import tempfile

import torch
from torch import nn

model = nn.Linear(16, 16).cuda()
optimizer = torch.optim.Adam(model.parameters())
for _ in range(2):
    loss = model(torch.randn(8, 16, device="cuda")).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
path = (
    sys.argv[1]
    if len(sys.argv) > 1
    else os.path.join(tempfile.gettempdir(), "vramledger_saves_checkpoint.pt")
)
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
print("saved", path)
