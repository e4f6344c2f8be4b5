"""Per-rank estimates on a fake process group: the ZeRO paper's table, DeepSpeed configs, JSON."""

import json
from dataclasses import replace

import pytest

from vramledger import Category, InputError, TrainingSpec, estimate
from vramledger.inputs.deepspeed_config import read_deepspeed_config

from .conftest import fixture

GPT_7_5B = fixture("gpt-7.5b.json")
K = 12
"""Bytes per parameter of mixed-precision Adam's optimizer states (fp32 copy, m, v)."""
PAPER_BYTES_PER_PARAM = {
    "ddp": 2 + 2 + K,
    "zero1": 2 + 2 + K / 64,
    "zero2": 2 + (2 + K) / 64,
    "zero3": (2 + 2 + K) / 64,
    "fsdp": (2 + 2 + K) / 64,
}
"""Rajbhandari et al., ZeRO (2020), Figure 1: model states per GPU of a Ψ = 7.5B model with
mixed-precision Adam on 64 GPUs — (2 + 2 + K)Ψ, (2 + 2 + K/N)Ψ, (2 + (2 + K)/N)Ψ,
(2 + 2 + K)Ψ/N: 120, 31.4, 16.6, 1.9 GB (the figure's values are these, rounded)."""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(PAPER_BYTES_PER_PARAM))
def test_zero_paper_model_state_per_gpu(strategy):
    """Every rank, not the mean: DeepSpeed's flat partition is even (the last rank holds the
    padding; a rank keeps the gradients of the whole parameters overlapping its partition)."""
    ledger = estimate(
        model=GPT_7_5B,
        batch_size=1,
        seq_len=64,
        precision="bf16-master",
        optimizer="adam",
        world_size=64,
        strategy=strategy,
    )
    paper = PAPER_BYTES_PER_PARAM[strategy]
    assert sum(len(ids) for ids, _ in ledger.ranks) == 64
    for ids, rank in ledger.ranks:
        per_param = rank.model_state_bytes / ledger.parameters
        assert abs(per_param - paper) / paper <= 0.02, (ids, per_param, paper)
    # the ledger returned is the rank with the highest peak
    assert ledger.allocated_peak_bytes == max(r.allocated_peak_bytes for _, r in ledger.ranks)


def test_zero_redundancy_optimizer_is_uneven_where_deepspeed_is_even():
    """PyTorch's ZeroRedundancyOptimizer (``zero1-torch``) assigns whole parameters: on the
    7.5B GPT over 64 ranks one rank steps far more than 1/64 of the parameters (the 206M
    embedding alone is 1.8/64); DeepSpeed's flat partition gives each 1/64 (issue 10)."""
    pytest.importorskip("deepspeed")
    from vramledger.inputs.recipe import resolve
    from vramledger.parallel.deepspeed_layout import zero_partitions
    from vramledger.parallel.engines import zero1_partition

    model = resolve(TrainingSpec(model=GPT_7_5B)).build_model("meta")
    params = list(model.parameters())
    share = sum(p.numel() for p in params) / 64
    torch_largest = max(
        sum(params[i].numel() for i in owned) for owned in zero1_partition(params, 64)
    )
    assert torch_largest > 1.5 * share
    deepspeed = zero_partitions([p.numel() for p in params], 64)
    assert max(r.partition_numel for r in deepspeed) < share + 128


def test_deepspeed_partition_is_deepspeeds_own():
    """The planner's restatement of the partition agrees with DeepSpeed's own code, and the
    partition is even: 1/N of the padded flat buffer on every rank."""
    pytest.importorskip("deepspeed")
    from vramledger.inputs.recipe import resolve
    from vramledger.parallel.deepspeed_layout import even_partitions, zero_partitions

    model = resolve(TrainingSpec(model=GPT_7_5B)).build_model("meta")
    numels = [p.numel() for p in model.parameters()]
    for sizes, world in ((numels, 64), ([7, 1000, 3, 50, 50, 2], 4), ([5, 3], 8)):
        ours, theirs = even_partitions(sizes, world), zero_partitions(sizes, world)
        assert ours == theirs
        total = sum(sizes)
        assert {r.partition_numel for r in theirs} == {theirs[0].flat_numel // world}
        assert sum(r.padding for r in theirs) == theirs[0].flat_numel - total
        assert theirs[0].flat_numel % (2 * world) == 0
    assert sum(numels) == 7_459_729_408


def test_distributed_json_contract_and_sharding_categories():
    ledger = estimate(
        model=fixture("tiny-llama.json"),
        seq_len=32,
        precision="bf16-master",
        world_size=4,
        strategy="fsdp",
    )
    data = ledger.to_dict()
    assert {
        "ranks",
        "worst_rank",
        "model_state_bytes",
        "cpu_bytes",
        "world_size",
        "strategy",
    } <= set(data)
    assert data["ranks"][0]["rank_ids"] == [0, 1, 2, 3]
    assert {"peak_bytes", "at_peak", "phases"} <= set(data["ranks"][0])
    assert ledger.at_peak[Category.SHARDED_PARAMETERS] > 0
    tl = ledger.timeline
    used = {tl.category(s) for s in range(tl.num_storages)}
    assert {Category.SHARDED_GRADIENTS, Category.ALL_GATHER_BUFFERS} <= used
    json.dumps(data)


def test_ddp_adds_gradient_buckets_and_zero1_shards_optimizer_state():
    base = dict(model=fixture("tiny-llama.json"), seq_len=32, world_size=4)
    ddp = estimate(strategy="ddp", **base)
    assert ddp.at_peak[Category.GRADIENT_BUCKETS] == ddp.at_peak[Category.PARAMETERS]  # fp32 grads
    for strategy in ("zero1-torch", "zero1"):
        zero1 = estimate(strategy=strategy, **base)
        assert len(zero1.ranks) > 1  # partitions differ
        total_state = sum(len(ids) * r.optimizer_state_bytes for ids, r in zero1.ranks)
        assert total_state == pytest.approx(ddp.optimizer_state_bytes, rel=0.001)


def test_deepspeed_zero2_categories_and_notes():
    """DeepSpeed's buffers in their categories: the flat bf16 parameters, the fp32 partition
    (master weights), Adam's state of the partition, the reduce bucket (5e8 elements by
    default, allocated whole) and the gradients the rank keeps."""
    pytest.importorskip("deepspeed")
    ledger = estimate(
        model=fixture("tiny-llama.json"),
        seq_len=32,
        precision="bf16-master",
        world_size=2,
        strategy="zero2",
    )
    tl = ledger.timeline
    used = {tl.category(s) for s in range(tl.num_storages)}
    assert {Category.SHARDED_GRADIENTS, Category.GRADIENT_BUCKETS} <= used
    assert ledger.at_peak[Category.GRADIENT_BUCKETS] == 500_000_000 * 2
    params = ledger.trainable_parameters
    assert ledger.at_peak[Category.PARAMETERS] == 2 * params  # no padding: 2·2 divides it
    assert ledger.at_peak[Category.MASTER_WEIGHTS] == 4 * params // 2
    assert ledger.optimizer_state_bytes == pytest.approx(8 * params // 2, abs=64)
    assert any("DeepSpeed" in n and "DeepSpeedZeroOptimizer stage 2" in n for n in ledger.notes)
    assert any("FusedAdam" in n for n in ledger.notes)  # CUDA target: fused, in place


def test_offload_moves_categories_to_host():
    base = dict(
        model=fixture("tiny-llama.json"),
        seq_len=32,
        world_size=4,
        strategy="zero2",
        precision="bf16-master",
    )
    plain, offloaded = estimate(**base), estimate(offload="optimizer", **base)
    assert offloaded.at_peak[Category.OPTIMIZER_STATE] == 0
    assert offloaded.at_peak[Category.MASTER_WEIGHTS] == 0
    assert offloaded.host_bytes >= plain.optimizer_state_bytes
    assert offloaded.peak_bytes < plain.peak_bytes


def test_zero3_optimizer_offload_keeps_half_precision_shards_on_the_gpu():
    """FSDP2 keeps fp32 shards (the master weights under bf16-master); DeepSpeed's ZeRO-3
    offload_optimizer moves them to the host and keeps a bf16 copy of each shard on the GPU."""
    base = dict(
        model=fixture("tiny-llama.json"),
        seq_len=32,
        world_size=4,
        strategy="fsdp",
        precision="bf16-master",
    )
    plain, offloaded = estimate(**base), estimate(offload="optimizer", **base)
    fp32_shards = plain.at_peak[Category.SHARDED_PARAMETERS]
    # Every fp32 shard is 4-byte elements padded to whole rows; its bf16 copy is half of it.
    assert offloaded.at_peak[Category.SHARDED_PARAMETERS] * 2 == fp32_shards
    assert offloaded.at_peak[Category.MASTER_WEIGHTS] == 0
    assert offloaded.at_peak[Category.OPTIMIZER_STATE] == 0
    assert offloaded.host_bytes >= fp32_shards + plain.optimizer_state_bytes
    assert any("offload_optimizer" in note for note in offloaded.notes)


def test_one_trace_serves_all_symmetric_ranks():
    ledger = estimate(
        model=fixture("tiny-llama.json"), seq_len=32, world_size=1024, strategy="fsdp"
    )
    assert len(ledger.ranks) == 1 and len(ledger.ranks[0][0]) == 1024


def test_deepspeed_config(tmp_path):
    fields, _ = read_deepspeed_config("examples/ds_zero2_offload.json")
    assert fields == {
        "strategy": "zero2",
        "offload": "optimizer",
        "precision": "bf16-master",
        "batch_size": 1,
        "grad_accum": 4,
    }
    spec = TrainingSpec(
        model=fixture("tiny-llama.json"),
        seq_len=16,
        world_size=2,
        deepspeed="examples/ds_zero2_offload.json",
    )
    ledger = estimate(spec)
    assert ledger.strategy == "zero2" and ledger.spec["deepspeed"]
    # zero_optimization keys that change memory reach DeepSpeed's engine
    small = tmp_path / "small_bucket.json"
    small.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 10_000}}))
    zero1 = estimate(replace(spec, deepspeed=str(small), precision="bf16-master"))
    assert zero1.strategy == "zero1"
    assert zero1.at_peak.get(Category.GRADIENT_BUCKETS, 0) in (0, 10_000 * 2)
    assert any("reduce bucket of 10,000 elements" in n for n in zero1.notes)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_magic": 1}}))
    with pytest.raises(InputError, match="stage3_magic"):
        read_deepspeed_config(bad)
    bad.write_text(
        json.dumps({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}})
    )
    with pytest.raises(InputError, match="nvme"):
        read_deepspeed_config(bad)
    # DeepSpeed offloads the optimizer under ZeRO 1-3 only, the parameters under ZeRO-3 only
    for stage, key in ((0, "offload_optimizer"), (2, "offload_param")):
        bad.write_text(json.dumps({"zero_optimization": {"stage": stage, key: {"device": "cpu"}}}))
        with pytest.raises(InputError, match=f"{key} is valid only with ZeRO stage"):
            read_deepspeed_config(bad)
    bad.write_text(json.dumps({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}))
    with pytest.raises(InputError, match="train_batch_size"):
        estimate(TrainingSpec(model=fixture("tiny-llama.json"), world_size=2, deepspeed=str(bad)))


def test_bad_parallel_options():
    with pytest.raises(InputError, match="world-size"):
        TrainingSpec(model="x", world_size=0)
    with pytest.raises(InputError, match="unknown strategy"):
        TrainingSpec(model="x", world_size=2, strategy="zero9")
    with pytest.raises(InputError, match="together"):
        TrainingSpec(model="x", nodes=2)
    assert TrainingSpec(model="x", nodes=2, gpus_per_node=8).world_size == 16
