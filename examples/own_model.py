"""A model of your own, for ``vramledger estimate examples/own_model.py:model``.

Three functions are all vramledger needs from your code: one that builds the ``nn.Module``
(called with no arguments, on the meta device, so nothing is allocated), one that makes a batch
(called with ``device=`` and, where it accepts them, ``batch_size=``, ``seq_len=``), and one that
computes the loss (``loss(model, batch)``, the scalar that ``backward()`` starts from).
"""

import torch
from torch import nn

VOCAB, WIDTH, HEADS, LAYERS = 32_000, 1024, 16, 12


class TinyDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.norm(self.blocks(self.embed(ids), mask=causal, is_causal=True)))


def model() -> nn.Module:
    return TinyDecoder()


def inputs(device, batch_size: int = 8, seq_len: int = 1024) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq_len + 1), device=device)
    return {"ids": ids[:, :-1], "labels": ids[:, 1:]}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
