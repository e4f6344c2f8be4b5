"""A small GAN: a generator and a discriminator, each with its own Adam, stepped in turn."""

import torch
from torch import nn

torch.manual_seed(0)
device = "cuda"
generator = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 64)).to(device)
discriminator = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1)).to(device)
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
bce = nn.BCEWithLogitsLoss()
ones = torch.ones(32, 1, device=device)
zeros = torch.zeros(32, 1, device=device)

for _step in range(4):
    real = torch.randn(32, 64, device=device)
    fake = generator(torch.randn(32, 16, device=device))
    d_loss = bce(discriminator(real), ones) + bce(discriminator(fake.detach()), zeros)
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = bce(discriminator(fake), ones)
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()

print("GAN peak bytes:", torch.cuda.max_memory_allocated())
