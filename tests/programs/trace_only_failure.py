"""A script that refuses to run on anything but plain tensors: it fails under any trace (its
tensors are fake there) and runs plainly. Its failure under `vramledger run` is vramledger's."""

import torch

lin = torch.nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
for _i in range(3):
    x = torch.randn(4, 8, device="cuda")
    if type(x) is not torch.Tensor:
        raise RuntimeError(f"expected a plain tensor, got {type(x).__name__}")
    lin(x).sum().backward()
    opt.step()
    opt.zero_grad()
