"""DeepSpeed as its "Getting Started" tutorial and ZeRO tutorial write a training script: a
config dict, ``deepspeed.initialize(model=..., model_parameters=..., config=...)``, and the
engine's own ``model_engine(batch)`` / ``model_engine.backward(loss)`` /
``model_engine.step()``; a small model and a few steps; each rank prints the peak
``torch.cuda.max_memory_allocated()`` reports. The config's AdamW is torch's
(``"torch_adam": true``, a documented optimizer parameter) unless ``--fused-adam`` asks for
DeepSpeed's FusedAdam, whose kernel DeepSpeed compiles on first use.

    deepspeed --num_gpus 2 deepspeed_torchrun.py --stage 2 --dtype bf16
    torchrun --nproc-per-node 2 deepspeed_torchrun.py --stage 2 --dtype bf16
"""

import argparse

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

DIM, VOCAB, LAYERS, BATCH, SEQ = 128, 256, 4, 4, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser(description="DeepSpeed ZeRO on a toy model")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--fused-adam", action="store_true", help="DeepSpeed's FusedAdam, not torch's AdamW"
    )
    args = parser.parse_args()

    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": not args.fused_adam}},
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": {
            "stage": args.stage,
            "reduce_bucket_size": 50_000,
            "allgather_bucket_size": 50_000,
        },
        "steps_per_print": 1000,
    }
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Model()
    model_engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    for _ in range(args.steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=model_engine.device)
        logits = model_engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        model_engine.backward(loss)
        model_engine.step()
    rank = torch.distributed.get_rank()
    print(f"rank {rank} peak bytes: {torch.cuda.max_memory_allocated()}")


if __name__ == "__main__":
    main()
