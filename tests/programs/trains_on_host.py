"""A training loop that runs on the device its command line names, the CPU by default (as many
scripts' ``--device`` option): run without ``--device cuda``, it trains on the host and puts
nothing on the GPU."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
device = torch.device(parser.parse_args().device)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)).to(device)
optimizer = torch.optim.Adam(model.parameters())
for _ in range(3):
    loss = model(torch.randn(16, 256, device=device)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
