"""Sets the default device from a parameter's device, as torchtitan's Llama builds its RoPE
table (``with torch.device(self.freqs_cis.device):``): on a GPU the table is GPU memory."""

import torch
from torch import nn

model = nn.Linear(8, 8).cuda()
with torch.device(model.weight.device):
    table = torch.zeros(1024, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
print("table on", table.device)
