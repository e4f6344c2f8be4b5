"""bitsandbytes' layers used directly: a 4-bit (NF4, double-quantized) and an 8-bit (LLM.int8)
layer, frozen, between trainable ones, moved to the GPU with .cuda() (bitsandbytes quantizes
them there), AdamW for three steps."""

import bitsandbytes as bnb
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(64, 256),
    bnb.nn.Linear4bit(256, 512, compute_dtype=torch.bfloat16, quant_type="nf4"),
    nn.ReLU(),
    bnb.nn.Linear8bitLt(512, 256, has_fp16_weights=False, threshold=6.0),
    nn.ReLU(),
    nn.Linear(256, 10),
).cuda()
for layer in (model[1], model[3]):
    layer.requires_grad_(False)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
x = torch.randn(32, 64, device="cuda")
y = torch.randint(0, 10, (32,), device="cuda")
for _ in range(3):
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
print("bnb layers peak bytes:", torch.cuda.max_memory_allocated())
