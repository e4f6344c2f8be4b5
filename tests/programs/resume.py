"""Resuming from a checkpoint that a GPU run saved: the file is read with map_location="cuda",
the model is trained on, and the new checkpoint save is skipped under vramledger run."""

import os
import sys
import tempfile

import torch
from torch import nn

path = (
    sys.argv[1]
    if len(sys.argv) > 1
    else os.path.join(tempfile.gettempdir(), "vramledger_resume_checkpoint.pt")
)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
optimizer = torch.optim.Adam(model.parameters())
checkpoint = torch.load(path, map_location="cuda", weights_only=True)
model.load_state_dict(checkpoint["model"])
del checkpoint
for _ in range(3):
    loss = model(torch.randn(16, 64, device="cuda")).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("resume peak bytes:", torch.cuda.max_memory_allocated())
