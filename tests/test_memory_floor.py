"""Sizes no GPU could hold are refused before any trace (memory_floor.py; issue 32: "inputs
checked before work"): the floor is what the trace itself puts on the devices, and a refusal
comes only where the floor exceeds every rank's memory of the largest GPU."""

from dataclasses import replace

import pytest

import vramledger.predict.step
from vramledger import estimate
from vramledger.cli import main
from vramledger.inputs import memory_floor
from vramledger.inputs.categories import Category
from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import Gpu
from vramledger.inputs.spec import MAX_SEQ_LEN, TrainingSpec

from .conftest import fixture

TINY = fixture("tiny-llama.json")
LLAMA_70B = fixture("../../examples/configs/llama-2-70b.json")


@pytest.fixture
def untraced(monkeypatch):
    def traced(*args, **kwargs):
        raise AssertionError("traced before the sizes were checked")

    monkeypatch.setattr(vramledger.predict.step, "trace", traced)


@pytest.mark.parametrize(
    "fields",
    [{}, {"precision": "bf16-true"}, {"world_size": 2, "strategy": "fsdp"}],
    ids=["fp32", "bf16-true", "fsdp-2"],
)
def test_the_floor_is_what_the_trace_puts_on_the_devices(fields):
    """The trace's parameters (every rank's shards summed) and inputs at the start of the last
    step are the floor's, to the byte before the allocator's rounding."""
    spec = TrainingSpec(model=TINY, seq_len=32, **fields)
    floor = memory_floor.memory_floor(spec)
    ledger = estimate(spec)
    held = {Category.PARAMETERS, Category.SHARDED_PARAMETERS}
    parameters = sum(
        len(ids) * sum(b for c, b in rank.at_peak.items() if c in held)
        for ids, rank in ledger.ranks
    )
    assert parameters == floor.parameter_bytes
    assert ledger.at_peak[Category.INPUTS] == floor.input_bytes == 2 * 32 * 8  # ids, labels
    assert floor.parameters == ledger.parameters


def test_parameters_offloaded_to_the_host_are_not_on_the_floor():
    spec = TrainingSpec(model=TINY, world_size=2, strategy="fsdp", offload="params")
    assert memory_floor.memory_floor(spec).parameter_bytes == 0


def test_refused_only_beyond_every_ranks_memory(monkeypatch):
    """At the floor exactly it is traced; one byte less of memory per rank, refused."""
    spec = TrainingSpec(model=TINY, seq_len=32, world_size=2, strategy="fsdp")
    total = memory_floor.memory_floor(spec).total_bytes
    assert total % 2 == 0

    def catalogue(memory):
        gpu = Gpu(name="small", memory_bytes=memory, compute_capability=(9, 0), source="test")
        monkeypatch.setattr(memory_floor, "CATALOGUE", {"small": gpu})

    catalogue(total // 2)
    memory_floor.check_floor(spec)
    catalogue(total // 2 - 1)
    with pytest.raises(InputError, match=r"no GPU could hold this step.*more than 2 × "):
        memory_floor.check_floor(spec)
    memory_floor.check_floor(replace(spec, target="cpu"))  # a CPU's memory is the host's
    memory_floor.check_floor(replace(spec, gpu_memory=total, margin=0))  # a GPU that large, asked


CASES = {
    # 68.98 B parameters in fp32: 256.96 GiB, more than the catalogue's largest (mi300x, 178.81 GiB)
    "70B in fp32 on one GPU": (
        [LLAMA_70B, "--gpu", "h100-80gb"],
        "no GPU could hold this step: its 68,976,648,192 parameters (256.96 GiB) and one "
        "micro-batch of inputs (8.00 KiB) come to 256.96 GiB, more than 1 × 178.81 GiB (mi300x, "
        "the largest GPU in the catalogue); it needs 2 such GPUs or more (`vramledger plan --gpu "
        "NAME` finds how many) or the parameters offloaded (--offload params), or give "
        "--gpu-memory SIZE to trace it on a GPU that large",
    ),
    # 10^12 tokens of int64 ids and labels: 14.55 TiB
    "a batch of 10^12 tokens": (
        [TINY, "--batch-size", "1000000", "--seq-len", "1000000"],
        "one micro-batch of inputs (14.55 TiB) come to 14.55 TiB, more than 1 × 178.81 GiB "
        "(mi300x, the largest GPU in the catalogue); check --batch-size, --seq-len and "
        "--image-size",
    ),
    "a sequence beyond any context": (
        [TINY, "--seq-len", str(10**9)],
        f"seq-len 1,000,000,000 is beyond any model's context (vramledger models at most "
        f"{MAX_SEQ_LEN:,} tokens)",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_refused_in_one_line_before_any_trace(case, capsys, untraced):
    args, expected = CASES[case]
    code = main(["estimate", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().count("\n") == 0 and expected in err, err


def test_the_refusal_names_the_gpu_asked_for_when_larger(capsys, untraced):
    code = main(["estimate", LLAMA_70B, "--gpu-memory", "200GiB"])
    err = capsys.readouterr().err
    assert code == 2 and "more than 1 × 200.00 GiB (the GPU asked for)" in err
