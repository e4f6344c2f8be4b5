"""NCCL's PREMUL_SUM on the real CPU run's gloo group: a SUM, then the result scaled in place
(``trace/core/premul_sum.py``; FSDP2 asks for it under ``set_gradient_divide_factor``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from vramledger.trace.core.premul_sum import premul_factor, reduce_then_scale


def test_only_premul_sum_has_a_factor():
    assert premul_factor({"op": ReduceOp.PREMUL_SUM(0.5)}) == 0.5
    assert premul_factor({"op": ReduceOp.SUM}) is None  # a RedOpType member, no .op
    assert premul_factor({"op": ReduceOp.AVG}) is None
    assert premul_factor({}) is None


def test_premul_sum_runs_as_sum_then_scales_the_output_in_place(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        output, input = torch.zeros(4), torch.arange(4.0)
        kept = output.data_ptr()
        work = reduce_then_scale(
            dist.reduce_scatter_single, (output, input), {"op": ReduceOp.PREMUL_SUM(0.25)}
        )
        assert work is None
        assert output.tolist() == [0.0, 0.25, 0.5, 0.75] and output.data_ptr() == kept
        total = torch.ones(3)
        reduce_then_scale(dist.all_reduce, (total,), {"op": ReduceOp.SUM})
        assert total.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
