"""Pipeline parallelism as PyTorch's "Introduction to Distributed Pipeline Parallelism" tutorial
and the ``torch.distributed.pipelining`` docs write it: the whole model built on every rank,
then split by hand (each rank deletes the layers of the other stages, and the first stage its
norm and output, the last its embedding: the model's forward skips what is ``None``), a
``PipelineStage`` built without example inputs (its shapes inferred at the first step, sent
from stage to stage; with ``--shapes given`` it gets its ``input_args`` and ``output_args``),
a schedule (``ScheduleGPipe``, or ``Schedule1F1B`` with ``--schedule
1f1b``) over micro-batches with a token-wise cross-entropy ``loss_fn``; each rank's optimizer
steps its stage's parameters. Each rank prints the peak ``torch.cuda.max_memory_allocated()``
reports.

    torchrun --nproc-per-node 2 pp_torchrun.py [--schedule 1f1b]
"""

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 256


class Transformer(nn.Module):
    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # Using a ModuleDict lets us delete layers without affecting names,
        # ensuring checkpoints will correctly save and load.
        self.layers = torch.nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(
                model_args.dim, model_args.n_heads, dim_feedforward=4 * model_args.dim
            )
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor):
        # Handling layers being 'None' at runtime enables easy pipeline splitting
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, h)
        h = self.norm(h) if self.norm else h
        output = self.output(h).clone() if self.output else h
        return output


def init_distributed():
    global rank, device, pp_group, stage_index, num_stages
    rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group()
    # This group can be a sub-group in the N-D parallel case
    pp_group = dist.new_group()
    stage_index = rank
    num_stages = world_size


def example_shapes(model_args, microbatch):
    """One micro-batch's input and output of this stage, as the pipelining docs give a
    ``PipelineStage`` its ``input_args`` and ``output_args`` (then no shape is inferred)."""
    hidden = torch.empty(*microbatch.shape, model_args.dim, device="meta", requires_grad=True)
    logits = torch.empty(*microbatch.shape, model_args.vocab_size, device="meta")
    inputs = microbatch if stage_index == 0 else hidden
    outputs = logits if stage_index == num_stages - 1 else hidden
    return inputs, outputs


def manual_model_split(model, shapes=(None, None)) -> PipelineStage:
    half = len(model.layers) // 2
    if stage_index == 0:
        # prepare the first stage model
        for i in range(half, 2 * half):
            del model.layers[str(i)]
        model.norm = None
        model.output = None
    elif stage_index == 1:
        # prepare the second stage model
        for i in range(half):
            del model.layers[str(i)]
        model.tok_embeddings = None
    inputs, outputs = shapes
    stage = PipelineStage(
        model, stage_index, num_stages, device, input_args=inputs, output_args=outputs
    )
    return stage


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--shapes",
        choices=["inferred", "given", "given-on-rank-0"],
        default="inferred",
        help="give each stage its input_args/output_args (given), or only rank 0's",
    )
    cli = parser.parse_args()
    init_distributed()
    num_microbatches = 4
    model_args = ModelArgs()
    torch.manual_seed(0)
    model = Transformer(model_args)

    # Dummy data
    x = torch.ones(8, 32, dtype=torch.long)
    y = torch.randint(0, model_args.vocab_size, (8, 32), dtype=torch.long)

    example_input_microbatch = x.chunk(num_microbatches)[0]
    given = cli.shapes == "given" or (cli.shapes == "given-on-rank-0" and rank == 0)
    shapes = example_shapes(model_args, example_input_microbatch) if given else (None, None)
    stage = manual_model_split(model, shapes)
    model.to(device)
    x = x.to(device)
    y = y.to(device)

    def tokenwise_loss_fn(outputs, targets):
        loss_fn = nn.CrossEntropyLoss()
        outputs = outputs.reshape(-1, model_args.vocab_size)
        targets = targets.reshape(-1)
        return loss_fn(outputs, targets)

    schedule_class = Schedule1F1B if cli.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_class(stage, n_microbatches=num_microbatches, loss_fn=tokenwise_loss_fn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for _ in range(cli.steps):
        if rank == 0:
            schedule.step(x)
        elif rank == 1:
            losses = []
            output = schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {rank} peak bytes: {torch.cuda.max_memory_allocated()}")
    dist.destroy_process_group()
