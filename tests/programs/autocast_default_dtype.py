"""torch.autocast("cuda") with no dtype: CUDA's default, float16 (CPU autocast's is bfloat16)."""

import torch

model = torch.nn.Linear(64, 64).cuda()
with torch.autocast("cuda"):
    out = model(torch.randn(8, 64, device="cuda"))
print("autocast dtype:", out.dtype)
