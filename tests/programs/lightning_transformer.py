"""Lightning's own demo transformer (lightning.pytorch.demos.LightningTransformer: Lightning's
model code, its SGD from configure_optimizers) trained by Lightning's Trainer on one GPU under
Lightning's bf16-mixed (autocast over fp32 weights), on batches of random tokens made here."""

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
    precision="bf16-mixed",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Demo(vocab_size=VOCAB), DataLoader(TensorDataset(tokens, targets), batch_size=8))
print("lightning peak bytes:", torch.cuda.max_memory_allocated())
