"""A loop that keeps its best checkpoint and reloads it, as training scripts do: the state saved
through an open file (``open(path, "wb")`` + ``torch.save``), then read back with
``torch.load(path, map_location="cuda")`` and loaded into the model and optimizer."""

import sys
from pathlib import Path

import torch
from torch import nn

path = Path(sys.argv[1] if len(sys.argv) > 1 else "best.pt")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(4):
    loss = model(torch.randn(32, 128, device="cuda")).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
    state = torch.load(path, map_location="cuda")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
print("save and load peak bytes:", torch.cuda.max_memory_allocated())
