"""Lightning's own demo transformer (lightning.pytorch.demos.LightningTransformer) whose
training step also logs its loss, as nearly every LightningModule does
(``self.log("train_loss", loss, prog_bar=True)``: Lightning's result collection keeps it in a
torchmetrics metric, whose ``add_state`` deep-copies a tensor made inside the optimizer's
step), trained by Lightning's Trainer on one GPU on random tokens made here."""

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

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss


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
