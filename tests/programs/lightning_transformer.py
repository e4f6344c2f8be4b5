"""Lightning's own demo transformer (lightning.pytorch.demos.LightningTransformer: Lightning's
model code, its SGD from configure_optimizers) trained by Lightning's Trainer on one GPU, on
batches of random tokens made here. The precision is Lightning's name, the first argument
(default bf16-mixed: autocast over fp32 weights; bf16-true: bf16 weights)."""

import sys

import lightning as L
import torch
from lightning.pytorch.demos import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
VOCAB = 1000
tokens = torch.randint(0, VOCAB, (64, 32))
targets = torch.randint(0, VOCAB, (64, 32))


class Demo(LightningTransformer):
    def prepare_data(self):  # the demo downloads WikiText-2 here; the batches are made above
        pass


trainer = L.Trainer(
    accelerator="gpu",
    devices=1,
    max_steps=4,
    precision=sys.argv[1] if len(sys.argv) > 1 else "bf16-mixed",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Demo(vocab_size=VOCAB), DataLoader(TensorDataset(tokens, targets), batch_size=8))
print("lightning peak bytes:", torch.cuda.max_memory_allocated())
