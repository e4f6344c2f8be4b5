"""A compiled model that returns its logits with its loss, as Hugging Face's causal LMs do
(their KV cache too): only the loss is differentiated, so autograd hands the compiled backward
a zero tangent for the logits, materialized with ``at::zeros`` on the logits' device."""

import torch
from torch import nn


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 512)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.relu(self.body(x)))
        return nn.functional.cross_entropy(logits, y), logits


model = torch.compile(Head().cuda())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(128, 64).cuda()
y = torch.randint(0, 512, (128,)).cuda()
for _ in range(3):
    loss, logits = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"compiled peak bytes: {torch.cuda.max_memory_allocated()}")
