"""Mixed precision with torch.autocast on the GPU (bf16), LayerNorm and cross-entropy."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10)).cuda()
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(3):
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("autocast peak bytes:", torch.cuda.max_memory_allocated())
