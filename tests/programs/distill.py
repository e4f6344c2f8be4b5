"""Knowledge distillation: a frozen teacher, a smaller student trained on the teacher's soft
labels with momentum SGD."""

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
device = torch.device("cuda")
teacher = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
teacher.eval().requires_grad_(False)
student = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
optimizer = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)
temperature = 2.0

for _step in range(4):
    x = torch.randn(128, 64, device=device)
    labels = torch.randint(0, 10, (128,), device=device)
    with torch.no_grad():
        soft = F.softmax(teacher(x) / temperature, dim=-1)
    logits = student(x)
    loss = F.kl_div(
        F.log_softmax(logits / temperature, dim=-1), soft, reduction="batchmean"
    ) * temperature**2 + F.cross_entropy(logits, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

print("distillation peak bytes:", torch.cuda.max_memory_allocated())
