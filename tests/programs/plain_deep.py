"""A decoder-only transformer written here in plain PyTorch (pre-norm blocks in an
nn.ModuleList), moved to the GPU and trained with AdamW for three steps on random tokens;
prints its peak. Arguments: layers, width, heads, vocabulary, sequence length (default: a tiny
model), and "indexed" to call the blocks by index up to its own count of layers."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

LAYERS, WIDTH, HEADS, VOCAB, SEQ = (int(a) for a in (sys.argv[1:6] or [6, 64, 4, 256, 32]))
INDEXED = sys.argv[6:] == ["indexed"]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if INDEXED:
            for i in range(LAYERS):
                x = self.blocks[i](x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.norm(x))


torch.manual_seed(0)
model = Model().cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(3):
    ids = torch.randint(0, VOCAB, (1, SEQ + 1), device="cuda")
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("plain peak bytes:", torch.cuda.max_memory_allocated())
