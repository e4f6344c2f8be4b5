"""A script that sets its process's threads, as Lightning's CPU launcher
(``_set_num_threads_if_needed``) and torchtune's offload recipes (``set_torch_num_threads``) do,
then trains a step."""

import os

import torch
from torch import nn

os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
model = nn.Linear(16, 4).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    loss = model(torch.randn(4, 16, device="cuda")).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
