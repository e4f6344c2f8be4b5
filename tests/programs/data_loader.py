"""A dataset in host memory, batches from a DataLoader moved to the GPU; the model is built
under a `torch.device("cuda")` context."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
with torch.device("cuda"):
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.Adam(model.parameters())
data = TensorDataset(torch.randn(128, 64), torch.randint(0, 10, (128,)))
for x, y in DataLoader(data, batch_size=32, shuffle=True):
    x, y = x.to("cuda", non_blocking=True), y.cuda()
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("data loader peak bytes:", torch.cuda.max_memory_allocated())
