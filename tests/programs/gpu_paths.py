"""What a program asks of its tensors' device, and the GPU-only paths it takes when they are CUDA
tensors: it prints what it was told, moves a result to the host, copies an activation into a
host buffer (as activation offloading does), loads a CPU state dict into the model on the GPU,
and adds with a Triton kernel where its tensors are CUDA tensors and Triton is installed."""

import importlib.util

import torch
from torch import nn

model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}  # a CPU checkpoint
model = model.cuda()
model.load_state_dict(state)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
weight = model[0].weight
print("device:", weight.device, weight.is_cuda, weight.get_device())

triton = importlib.util.find_spec("triton") is not None
if triton:
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x + tl.load(y_ptr + offs, mask=mask), mask=mask)


for _step in range(3):
    x = torch.randn(64, 256, device="cuda")
    if x.is_cuda and triton:
        doubled = torch.empty_like(x)
        add_kernel[(triton.cdiv(x.numel(), 1024),)](x, x, doubled, x.numel(), BLOCK=1024)
    else:
        doubled = x + x
    offloaded = torch.empty_like(doubled, device="cpu", pin_memory=True)
    offloaded.copy_(doubled)
    loss = model(doubled).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    host = loss.detach().cpu()
    print("host:", host.device, host.is_cuda)
