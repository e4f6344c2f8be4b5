"""Activation memory of one transformer layer against Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022), Table 2.

    python benchmarks/activations.py [--tp 2 4 8] [--json FILE] [--compare OLD.json]

The model is ``benchmarks/gpt_layer.py`` (the layer the paper counts: LayerNorms, Q/K/V, eager
attention with a causal mask, softmax, attention dropout, output projection and dropout, a 4h
MLP with GELU and dropout), traced for a CUDA A100 in bf16 (``--precision bf16-true``: the
paper's 16-bit activations). The traced number is what the forward leaves saved for backward in
the modules of layer 1 (``layers.1``; layer 0 also holds the embedding's output): the trace's
activations by module at the end of the first forward (``replay.replay``). Tensor parallelism
runs PyTorch's own ``parallelize_module`` with ``gpt_layer.py:tp_plan`` (Megatron's split) and
``gpt_layer.py:tp_sp_plan`` (with sequence parallelism), on a fake process group; each rank's
ledger is the same, rank 0's is shown.

The paper's formulas, bytes per layer (s sequence, b batch, h hidden, a heads, t tensor-parallel
degree; 2-byte activations, 1-byte dropout masks):

    no parallelism        sbh (34 + 5as/h)
    tensor parallel       sbh (10 + 24/t + 5as/(ht))
    tensor + sequence     sbh (34/t + 5as/(ht))

The formulas explain; the trace decides. The table prints the difference in units of sbh.

Every difference, from the trace's own tensors (op and module of each saved tensor), at
s = h = 512, b = 1, a = 8 (so s^2 b = sbh):

- **+1.0 sbh in every row: the causal mask.** ``masked_fill`` keeps the s x s bool mask for
  backward (s^2 b bytes per layer here, = 1.0 sbh); Megatron's fused scale-mask-softmax kernel
  makes the mask inside the kernel and saves nothing. Every tensor-parallel rank builds the
  whole mask, so it is not divided by t.
- **+0.016 sbh (÷ t with sequence parallelism): LayerNorm statistics.** ``native_layer_norm``
  saves mean and rstd (2 x s·b values per LayerNorm, two per layer), which the paper leaves
  out. The trace keeps them in bf16, as the CPU kernel makes them; CUDA's kernel makes them in
  fp32 (``layer_norm_kernel.cu``: ``toAccumulateType``), 4 KiB more per layer here, not
  modelled (8 bytes per token per LayerNorm under bf16 on CUDA against the 4 counted).
- **+4 sbh (1 - 1/t) with sequence parallelism: the gathered inputs of the column-parallel
  layers.** PyTorch's ``ColwiseParallel(input_layouts=Shard(1))`` (and ``PrepareModuleInput``)
  all-gather the LayerNorm's sequence shard, and the ``Linear`` saves the gathered,
  full-sequence input for its weight gradient (Q/K/V share one, 2 sbh; the first MLP layer
  another, 2 sbh), where each rank's own share is (1/t) of it. Megatron's sequence parallelism
  saves only the shard and all-gathers it again in backward (Korthikanti et al. section 4.2.2).
  t = 2: +2.0, t = 4: +3.0, t = 8: +3.5 sbh, which with the mask and the statistics gives the
  +3.008, +4.004, +4.502 measured.
- Everything else matches the paper term by term: Q/K/V input 2sbh, Q and K 4sbh, scores
  through softmax 2as^2b, attention-dropout mask as^2b and output 2as^2b, V 2sbh, output
  projection input 2sbh, its dropout mask sbh, LayerNorm inputs 4sbh, the MLP's 8sbh input to
  GELU, GELU output 8sbh, its dropout mask sbh (dropout runs CUDA's fused kernel with a 1-byte
  mask, ``trace/emulation/cuda_policy.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from benchkit import compare  # noqa: E402

SEQ, BATCH = 512, 1
HIDDEN, HEADS = 512, 8
"""s, b, h, a of the comparison (``gpt_layer.py`` reads them from the environment)."""
LAYER = "layers.1"


def paper_bytes(kind: str, s: int, b: int, h: int, a: int, t: int) -> float:
    """Korthikanti et al. Table 2, bytes of activations per layer."""
    if kind == "none":
        return s * b * h * (34 + 5 * a * s / h)
    if kind == "tp":
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return s * b * h * (34 / t + 5 * a * s / (h * t))


def traced_bytes(kind: str, t: int) -> tuple[int, float]:
    from vramledger import estimate
    from vramledger.ledger.replay import replay

    layer = str(HERE / "gpt_layer.py")
    spec = dict(
        model=f"{layer}:gpt",
        inputs=f"{layer}:inputs",
        loss=f"{layer}:loss",
        seq_len=SEQ,
        batch_size=BATCH,
        precision="bf16-true",
        target="cuda",
        gpu="a100-80gb",
        optimizer="sgd",
        optimizer_kwargs={"foreach": False},  # replicated LayerNorms beside DTensor weights
    )
    if kind != "none":
        spec.update(tp=t, tp_plan=f"{layer}:{'tp_plan' if kind == 'tp' else 'tp_sp_plan'}")
    start = time.perf_counter()
    ledger = estimate(**spec)
    seconds = time.perf_counter() - start
    saved = replay(ledger.timeline).activations_by_module
    ours = sum(b for m, b in saved.items() if m == LAYER or m.startswith(LAYER + "."))
    return ours, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", type=Path, default=None)
    compare.add_arguments(parser, out=False)
    args = parser.parse_args(argv)
    if (status := compare.against_only(args)) is not None:
        return status
    os.environ.update(
        GPT_LAYER_HIDDEN=str(HIDDEN), GPT_LAYER_HEADS=str(HEADS), GPT_LAYER_SEQ=str(SEQ)
    )
    sbh = SEQ * BATCH * HIDDEN
    rows = []
    cases = [("none", 1)] + [(k, t) for t in args.tp for k in ("tp", "tp+sp")]
    print(f"s={SEQ} b={BATCH} h={HIDDEN} a={HEADS}; sbh = {sbh:,} bytes; bf16, CUDA A100 policy")
    print(
        f"{'case':<10}{'t':>3}{'traced B':>14}{'paper B':>14}{'traced/sbh':>12}"
        f"{'paper/sbh':>11}{'diff/sbh':>10}{'diff %':>9}{'s':>6}"
    )
    for kind, t in cases:
        ours, seconds = traced_bytes(kind, t)
        paper = paper_bytes(kind, SEQ, BATCH, HIDDEN, HEADS, t)
        row = dict(
            case=kind,
            t=t,
            traced_bytes=ours,
            paper_bytes=round(paper),
            traced_sbh=ours / sbh,
            paper_sbh=paper / sbh,
            seconds=round(seconds, 2),
        )
        rows.append(row)
        print(
            f"{kind:<10}{t:>3}{ours:>14,}{round(paper):>14,}{ours / sbh:>12.3f}"
            f"{paper / sbh:>11.3f}{(ours - paper) / sbh:>+10.3f}"
            f"{100 * (ours - paper) / paper:>+8.2f}%{seconds:>6.1f}"
        )
    result = dict(s=SEQ, b=BATCH, h=HIDDEN, a=HEADS, rows=rows)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return compare.after_run(args, args.json or result)


if __name__ == "__main__":
    raise SystemExit(main())
