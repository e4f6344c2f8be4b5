"""A model that makes its positions and causal mask on its input's device (`device=x.device`),
as GPT-style code does; the mask is saved for backward."""

import torch
from torch import nn


class TinyAttention(nn.Module):
    def __init__(self, dim: int = 64, vocab: int = 100, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device)
        mask = torch.ones(t, t, device=ids.device).tril()
        x = self.embed(ids) + self.position(positions)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * mask - (1 - mask) * 1e4
        return self.head(scores.softmax(-1) @ v)


torch.manual_seed(0)
model = TinyAttention().cuda()
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(3):
    ids = torch.randint(0, 100, (4, 128), device="cuda")
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("device-of-input peak bytes:", torch.cuda.max_memory_allocated())
