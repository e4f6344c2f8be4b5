"""Fine-tuning from a LitGPT-style checkpoint: ``lit_model.pth`` (a plain ``torch.save`` of the
model's state dict), read as ``litgpt.utils.load_checkpoint`` reads it on one device, with
Lightning's lazy loader, into a model on the GPU, then trained with AdamW. Its argument: the
file."""

import sys

import torch
from lightning.fabric.utilities.load import _lazy_load as lazy_load
from torch import nn

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
state_dict = lazy_load(sys.argv[1])
state_dict = state_dict.get("model", state_dict)
model.load_state_dict(state_dict, strict=True)
del state_dict
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    loss = model(torch.randn(16, 64, device="cuda")).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("lit_model peak bytes:", torch.cuda.max_memory_allocated())
