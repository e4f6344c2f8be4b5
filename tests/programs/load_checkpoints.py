"""Fine-tuning from two checkpoints another run wrote: a safetensors file for the body and a
torch.save file for the head, loaded on the CPU, copied into the model on the GPU, then trained
with AdamW. Its arguments: the two files."""

import sys

import torch
from safetensors.torch import load_file
from torch import nn

body_path, head_path = sys.argv[1], sys.argv[2]
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
body = load_file(body_path)
model[0].load_state_dict(body)
head = torch.load(head_path, weights_only=True)
model[2].load_state_dict(head)
del body, head
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    loss = model(torch.randn(16, 64, device="cuda")).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("checkpoints peak bytes:", torch.cuda.max_memory_allocated())
