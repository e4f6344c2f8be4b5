"""A torch.compile'd model under bf16 autocast with gradient clipping and a fused AdamW (LitGPT's
pretraining loop in small): Inductor's code calls its matrix products with out= (their CPU
scratch counts), and clip_grad_norm_ checks the norm of gradients the compiled backward made."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10)).cuda()
compiled = torch.compile(model)
optimizer = torch.optim.AdamW(model.parameters(), fused=True)
for _ in range(3):
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(compiled(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
print("compiled autocast peak bytes:", torch.cuda.max_memory_allocated())
