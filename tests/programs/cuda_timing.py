"""A loop that times its steps with CUDA events, runs its forward on a side stream inside an
NVTX range, and prints torch.cuda.memory_summary()."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
side = torch.cuda.Stream()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for step in range(3):
    start.record()
    with torch.cuda.stream(side), torch.cuda.nvtx.range(f"step {step}"):
        loss = model(torch.randn(16, 64, device="cuda")).square().mean()
    torch.cuda.current_stream().wait_stream(side)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    end.record()
    torch.cuda.synchronize()
    print(f"step {step}: {start.elapsed_time(end):.1f} ms")
print(torch.cuda.memory_summary())
print("timing peak bytes:", torch.cuda.max_memory_allocated())
