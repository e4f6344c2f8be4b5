"""Plain training loops, each written as its library's documentation writes it, measured by the
CPU allocator's own count and nothing else.

    torchrun --nproc-per-node WORLD tests/library_loops/worker.py OUT_DIR CASE [CASE ...]

No vramledger code runs here: the allocator counter (``vramledger.measure.cpu_allocator_count``, a small
C++ wrapper around c10's CPU allocator) is loaded from the extension file the test built, named
by ``VRAMLEDGER_COUNTER_SO``, without importing the package, and the script checks at the end
that no ``vramledger`` module was imported. The model, batch and loss are the test fixtures'
(``tests/fixtures/models.py``: ``deep_mlp``, ``mlp_inputs``, cross-entropy). Each rank writes
``OUT_DIR/rank-N.json``: [case, peak] per case run, in order (a case may be named more than
once: repeated runs in the same processes). The peak is the count's in the second step (the
steady step; the first makes the optimizer state), in bytes above what was live before the model
was built, which is what ``vramledger.estimate`` predicts as ``peak_bytes``.

The loops and their sources:

- ``fp32``: PyTorch's quickstart ("Optimizing the Model Parameters"): ``pred = model(X)``,
  ``loss = loss_fn(pred, y)``, ``loss.backward()``, ``optimizer.step()``,
  ``optimizer.zero_grad()``.
- ``bf16-mixed`` / ``16-mixed``: PyTorch's "Automatic Mixed Precision" recipe: forward and loss
  under ``torch.autocast``; for float16 a ``torch.amp.GradScaler`` (``scaler.scale(loss)
  .backward()``, ``scaler.step``, ``scaler.update``), ``zero_grad(set_to_none=True)``.
- ``bf16-true``: the model cast with ``.to(torch.bfloat16)`` and the inputs with it (what
  Lightning's ``bf16-true`` does), the quickstart's loop.
- ``deepspeed-*``: DeepSpeed's getting-started: ``deepspeed.initialize(model=...,
  model_parameters=..., config=...)``, ``loss = loss_fn(engine(x), y)``, ``engine.backward(loss)``,
  ``engine.step()``; on CPU ``DS_ACCELERATOR=cpu`` and ``deepspeed.init_distributed("gloo")``.
  DeepSpeed's engine is its own master-weight loop (bf16/fp16 weights, fp32 masters); in fp32
  (no ``bf16``/``fp16`` section) it wraps the optimizer in nothing. Without ZeRO (stage 0,
  ``deepspeed-bf16``, ``deepspeed-fp32``, ``deepspeed-stage0`` on 2 processes) it all-reduces
  the gradients through one flattened buffer, on one process too.
- ``ddp``: the DDP tutorial ("Getting Started with Distributed Data Parallel"):
  ``DDP(model)``, ``optimizer.zero_grad()``, ``loss_fn(ddp_model(x), y).backward()``,
  ``optimizer.step()``.
- ``zero1-torch``: ``ZeroRedundancyOptimizer``'s documented use: DDP and
  ``ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=...)``.
- ``fsdp``: FSDP2's ``fully_shard`` docs and torchtitan: ``fully_shard`` on each block, then on
  the root; the optimizer over the sharded (DTensor) parameters.
"""

import gc
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
STEPS = 2
"""Two steps, as vramledger's estimate: the first makes the optimizer state, the second is the
steady step whose peak is compared."""
LR = 1e-3
BATCH_SIZE = 8
"""As ``mlp_inputs``' default and the test's spec."""


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


count = _load("vramledger_cpu_allocator_count", os.environ["VRAMLEDGER_COUNTER_SO"])
models = _load("library_loop_models", str(HERE.parent / "fixtures" / "models.py"))
loss_fn = nn.CrossEntropyLoss()


def batches(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch, seen once per step (the estimate's batch is made once, too)."""
    batch = models.mlp_inputs("cpu", BATCH_SIZE)
    x = batch["x"].to(dtype)
    return [(x, batch["y"])] * STEPS


# -- the loops: each returns the allocator's peak of the second step --------------------------
def _quickstart(model: nn.Module, dtype: torch.dtype, base: int) -> int:
    """PyTorch's quickstart loop ("Optimizing the Model Parameters"): forward, loss, backward,
    step, then zero_grad."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step, (X, y) in enumerate(batches(dtype)):
        if step == 1:
            count.reset_peak()
        pred = model(X)
        loss = loss_fn(pred, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return count.peak() - base


def fp32(base: int) -> int:
    return _quickstart(models.deep_mlp(), torch.float32, base)


def _autocast(dtype: torch.dtype, base: int) -> int:
    net = models.deep_mlp()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    use_scaler = dtype == torch.float16
    scaler = torch.amp.GradScaler("cpu", enabled=use_scaler)
    for step, (input, target) in enumerate(batches()):
        if step == 1:
            count.reset_peak()
        with torch.autocast(device_type="cpu", dtype=dtype):
            output = net(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return count.peak() - base


def bf16_mixed(base: int) -> int:
    return _autocast(torch.bfloat16, base)


def fp16_mixed(base: int) -> int:
    return _autocast(torch.float16, base)


def bf16_true(base: int) -> int:
    """Lightning's bf16-true: the model in bf16, the quickstart loop."""
    return _quickstart(models.deep_mlp().to(torch.bfloat16), torch.bfloat16, base)


def _ddp_tutorial(ddp_model: nn.Module, optimizer: Any, base: int) -> int:
    """The loop of PyTorch's "Getting Started with DDP": zero_grad, forward, backward, step."""
    for step, (x, labels) in enumerate(batches()):
        if step == 1:
            count.reset_peak()
        optimizer.zero_grad()
        outputs = ddp_model(x)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    return count.peak() - base


def ddp(base: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_model = DDP(models.deep_mlp())
    return _ddp_tutorial(ddp_model, torch.optim.AdamW(ddp_model.parameters(), lr=LR), base)


def zero1_torch(base: int) -> int:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_model = DDP(models.deep_mlp())
    optimizer = ZeroRedundancyOptimizer(
        ddp_model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
    )
    return _ddp_tutorial(ddp_model, optimizer, base)


def fsdp(base: int) -> int:
    from torch.distributed.fsdp import fully_shard

    model = models.deep_mlp()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches()):
        if step == 1:
            count.reset_peak()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return count.peak() - base


def _deepspeed(config_name: str, dtype: torch.dtype, base: int) -> int:
    import deepspeed

    config = json.loads((HERE / config_name).read_text())
    model = models.deep_mlp()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    for step, (x, y) in enumerate(batches(dtype)):
        if step == 1:
            count.reset_peak()
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    return count.peak() - base


def deepspeed_bf16(base: int) -> int:
    return _deepspeed("ds_bf16.json", torch.bfloat16, base)


def deepspeed_fp32(base: int) -> int:
    return _deepspeed("ds_fp32.json", torch.float32, base)


def deepspeed_fp16(base: int) -> int:
    return _deepspeed("ds_fp16.json", torch.float16, base)


def deepspeed_zero1(base: int) -> int:
    return _deepspeed("ds_zero1_bf16.json", torch.bfloat16, base)


def deepspeed_zero2(base: int) -> int:
    return _deepspeed("ds_zero2_bf16.json", torch.bfloat16, base)


LOOPS = {
    "fp32": fp32,
    "bf16-mixed": bf16_mixed,
    "16-mixed": fp16_mixed,
    "bf16-true": bf16_true,
    "deepspeed-bf16": deepspeed_bf16,
    "deepspeed-fp32": deepspeed_fp32,
    "deepspeed-fp16": deepspeed_fp16,
    "deepspeed-stage0": deepspeed_bf16,
    "ddp": ddp,
    "zero1-torch": zero1_torch,
    "fsdp": fsdp,
    "deepspeed-zero1": deepspeed_zero1,
    "deepspeed-zero2": deepspeed_zero2,
}


def main(out: Path, cases: list[str]) -> None:
    if any(name in cases for name in LOOPS if name.startswith("deepspeed")):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    count.install()
    peaks = []
    for case in cases:
        torch.manual_seed(0)
        gc.collect()
        base = count.live()
        peaks.append([case, LOOPS[case](base)])
        gc.collect()
        dist.barrier()
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "vramledger")
    assert not loaded, f"vramledger code was imported into the measured process: {loaded}"
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(peaks))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
