"""Loads one large safetensors file on the CPU, moves it to the GPU and trains it as an
embedding table for one step. Its argument: the file (one tensor, "weight")."""

import sys

import torch
from safetensors import safe_open

with safe_open(sys.argv[1], framework="pt") as f:
    weight = torch.nn.Parameter(f.get_tensor("weight").cuda())
optimizer = torch.optim.SGD([weight], lr=0.1)
ids = torch.randint(0, weight.shape[0], (8,), device="cuda")
loss = weight[ids].sum()
loss.backward()
optimizer.step()
print("large peak bytes:", torch.cuda.max_memory_allocated())
