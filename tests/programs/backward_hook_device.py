"""A gradient hook that makes its scratch on the GPU in the backward (as FSDP2's pre-backward
unshard makes its all-gather buffers, ``device="cuda"``), and an optimizer whose step steps
another (as torchtitan's ``OptimizersContainer`` steps an AdamW per model part): one step per
iteration."""

import torch
from torch import nn


class Container(torch.optim.Optimizer):
    """An Optimizer over the parameters of the ones it steps, with no state of its own."""

    def __init__(self, optimizers):
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def scaled(grad):
    scratch = torch.empty(grad.numel(), device="cuda")  # on the GPU, inside the backward
    scratch.copy_(grad.flatten()).mul_(0.5)
    return scratch.view_as(grad)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
optimizer = Container([torch.optim.AdamW(model.parameters(), lr=1e-3)])
for _ in range(3):
    hidden = model[0](torch.randn(16, 64, device="cuda"))
    hidden.register_hook(scaled)
    model[2](model[1](hidden)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print("backward-hook peak bytes:", torch.cuda.max_memory_allocated())
