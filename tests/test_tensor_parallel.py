"""Tensor, sequence, context and expert parallelism on the N-D mesh (``parallel/mesh.py``).

Estimates run PyTorch's and transformers' own engines on a fake process group; the
multiprocess tests run the same engines on real gloo processes and compare each rank's
prediction with the CPU allocator's own count of the real run (``cpu_allocator_count``, every
thread; ``tests/mesh_real.py``)."""

import time

import pytest

from vramledger import TrainingSpec, estimate
from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.errors import InputError
from vramledger.inputs.recipe import resolve
from vramledger.parallel.mesh import (
    apply_inner_parallelism,
    fake_mesh,
    mesh_coords,
    mesh_dims,
    mesh_rank_groups,
)

from .conftest import FIXTURES, fixture
from .mesh_real import TENSOR_PARALLEL, check_against_real_runs

HUB = FIXTURES / "hub"
LLAMA = str(HUB / "tiny-llama-bf16")  # 4 query heads, 2 kv heads: tp 2
PLANS = fixture("tp_plans.py")
TEXT = dict(seq_len=32, batch_size=2, target="cpu")


# -- the mesh ---------------------------------------------------------------------------------
def test_mesh_follows_torchtitans_order_and_coordinates():
    spec = TrainingSpec(model=LLAMA, dp_shard=2, cp=2, tp=2, target="cuda", seq_len=32)
    assert mesh_dims(spec) == [("dp_shard", 2), ("cp", 2), ("tp", 2)]
    coords = [mesh_coords(r, spec) for r in range(8)]
    assert coords[0] == {"dp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0}
    assert coords[1]["tp"] == 1 and coords[2]["cp"] == 1 and coords[4]["dp"] == 1  # tp fastest
    assert len({tuple(c.values()) for c in coords}) == 8
    # expert parallelism borrows dp x cp ranks (torchtitan's dp_shard_in_ep x cp)
    ep = TrainingSpec(model=LLAMA, dp_shard=4, ep=2, target="cpu")
    assert mesh_dims(ep) == [("dp_shard_mod_ep", 2), ("dp_shard_in_ep", 2), ("tp", 1)]
    assert [mesh_coords(r, ep)["ep"] for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(InputError, match="multiple of cp"):
        mesh_dims(TrainingSpec(model=LLAMA, dp_shard=2, cp=4, ep=2, target="cuda"))


def test_json_gives_mesh_coords_for_every_distinct_rank():
    ledger = estimate(model=LLAMA, tp=2, dp_shard=2, **TEXT)
    data = ledger.to_dict()
    assert data["world_size"] == 4 and data["strategy"] == "fsdp"
    assert [r["mesh_coords"] for r in data["ranks"]] == [
        {"dp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0}
    ]
    assert data["ranks"][0]["rank_ids"] == [0, 1, 2, 3]
    # a data-parallel-only run: dp is the rank
    ddp = estimate(model=LLAMA, world_size=2, strategy="zero1-torch", **TEXT).to_dict()
    assert all(r["mesh_coords"]["dp"] == r["rank_ids"][0] for r in ddp["ranks"])


# -- tensor and sequence parallelism ----------------------------------------------------------
def test_family_plan_shards_every_projection_and_keeps_the_loss_parallel():
    spec = TrainingSpec(model=LLAMA, tp=2, **TEXT)
    recipe = resolve(spec)
    with fake_mesh(0, spec) as mesh:
        model = apply_inner_parallelism(recipe.build_model("meta"), mesh, spec, [], "fp32")
        local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    assert local["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 64 / 2 rows
    assert local["model.layers.0.self_attn.o_proj.weight"] == (64, 32)  # 64 / 2 columns
    assert local["model.embed_tokens.weight"] == (500, 64)  # the vocabulary split
    assert local["lm_head.weight"] == (500, 64)
    assert local["model.layers.0.input_layernorm.weight"] == (64,)  # replicated (SP)
    ledger = estimate(spec)
    assert any("sequence parallel norms, loss parallel" in n for n in ledger.notes)


def test_sequence_parallel_and_loss_parallel_hold_less_than_a_plain_plan():
    """A user plan (--tp-plan) without sequence parallelism keeps the norms' activations and
    the full logits on every rank."""
    sp = estimate(model=LLAMA, tp=2, **TEXT)
    plain = estimate(model=LLAMA, tp=2, tp_plan=f"{PLANS}:llama_without_sequence_parallel", **TEXT)
    assert any("llama_without_sequence_parallel" in n for n in plain.notes)
    forward = Phase.FORWARD
    assert sp.phases[forward] < plain.phases[forward]
    with pytest.raises(InputError, match="not a plan dict"):
        estimate(model=LLAMA, tp=2, tp_plan=f"{PLANS}:not_a_plan", **TEXT)


def test_uneven_shards_are_refused_before_tracing():
    """torch.chunk would split 1001 rows as 501 + 500, which the tensor-parallel styles cannot
    run (their activations are rebuilt as even shards): said before any trace, naming the
    parameter; an even model's tp ranks share one ledger."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
    )
    with pytest.raises(InputError, match=r"splits model.embed_tokens.weight unevenly"):
        estimate(model=config, tp=2, dp_shard=2, **TEXT)
    even = TrainingSpec(model=LLAMA, tp=2, dp_shard=2, **TEXT)
    assert mesh_rank_groups(even) == [[0, 1, 2, 3]]


def test_block_extension_is_exact_for_tensor_parallel_blocks():
    spec = TrainingSpec(model=fixture("tiny-llama-40l.json"), tp=2, dp_shard=2, **TEXT)
    extended = estimate(spec)
    assert any("extended the timeline" in n for n in extended.notes)
    from vramledger.parallel.mesh import MeshParallel
    from vramledger.predict.step import policy_for
    from vramledger.trace.core.fake import trace

    full = trace(spec, policy_for(spec), extend_blocks=False, engine=MeshParallel(spec))
    from vramledger.ledger.replay import replay, steady_peak

    assert steady_peak(replay(full.timeline)).total == extended.peak_bytes


def test_llama_70b_shape_with_tp_8_estimates_in_seconds():
    start = time.perf_counter()
    ledger = estimate(
        model=fixture("../../examples/configs/llama-3-70b.json"),
        seq_len=8192,
        precision="bf16-master",
        dp_shard=8,
        tp=8,
    )
    took = time.perf_counter() - start
    assert ledger.world_size == 64 and len(ledger.ranks) == 1
    # 70.55 B parameters: fp32 shards and AdamW's m and v over 64 ranks
    assert ledger.at_peak[Category.SHARDED_PARAMETERS] == pytest.approx(70.55e9 * 4 / 64, rel=1e-3)
    assert ledger.at_peak[Category.OPTIMIZER_STATE] == pytest.approx(70.55e9 * 8 / 64, rel=1e-3)
    assert took < 60, took


# -- context parallelism ----------------------------------------------------------------------
def test_context_parallel_splits_the_sequence():
    """PyTorch's context_parallel (ring attention around CUDA's kernels): what a rank keeps for
    backward halves with each doubling of cp."""
    from vramledger.ledger.replay import replay

    spec = dict(model=LLAMA, seq_len=256, batch_size=4, precision="bf16-master", target="cuda")
    saved = {}
    for cp in (1, 2, 4):
        ledger = estimate(cp=cp, **spec)
        # what the forward leaves for backward, by module (the peak may be elsewhere: at cp 4
        # the optimizer step's)
        saved[cp] = sum(replay(ledger.timeline).activations_by_module.values())
        if cp > 1:
            assert any("context_parallel" in n for n in ledger.notes)
    assert saved[2] < 0.6 * saved[1] and saved[4] < 0.6 * saved[2], saved


def test_context_parallel_needs_cuda_kernels_and_a_divisible_sequence():
    with pytest.raises(InputError, match="CUDA attention kernels"):
        estimate(model=LLAMA, cp=2, seq_len=64, target="cpu")
    with pytest.raises(InputError, match="2 x cp = 4"):
        estimate(model=LLAMA, cp=2, seq_len=66, target="cuda")
    # fp32 grouped-query attention runs CUDA's math kernel, which ring attention does not wrap
    with pytest.raises(InputError, match="falls back to the math kernel"):
        estimate(model=LLAMA, cp=2, seq_len=64, target="cuda", precision="fp32")


# -- expert parallelism -----------------------------------------------------------------------
def test_expert_parallel_shards_the_experts_and_exchanges_tokens():
    qwen = str(HUB / "qwen3-moe-tiny-bf16")  # 8 experts, top-2
    spec = TrainingSpec(model=qwen, dp_shard=4, ep=4, **TEXT)
    recipe = resolve(spec)
    with fake_mesh(0, spec) as mesh:
        model = apply_inner_parallelism(recipe.build_model("meta"), mesh, spec, [], "fp32")
        experts = model.model.layers[0].mlp.experts
        assert experts.num_experts == 2  # 8 / ep 4, whole experts per rank
    ledger = estimate(spec)
    ops = set(ledger.timeline.op)
    assert "_c10d_functional.all_to_all_single.default" in ops
    assert any("expert parallel over 4 ranks" in n for n in ledger.notes)
    # the tokens each rank receives depend on the routing: every routing is traced
    assert set(ledger.moe_routing_peaks) == {"balanced", "first", "last"}


def test_expert_parallel_gathers_only_the_local_experts():
    """ep borrowed from the cp ranks, FSDP2 over dp x cp (torchtitan's layout): a rank holds
    half the experts either way (FSDP shards them over the 2 ranks, or ep places 4 of 8 whole
    experts on each), but under ep a layer's forward gathers only its own 4 experts."""
    from vramledger.ledger.replay import series

    spec = dict(
        model=str(HUB / "qwen3-moe-tiny-bf16"),
        seq_len=64,
        target="cuda",
        cp=2,
        precision="bf16-master",
    )
    gathered, sharded = {}, {}
    for ep in (1, 2):
        ledger = estimate(ep=ep, **spec)
        by = series(ledger.timeline, points=len(ledger.timeline.events)).by_category
        gathered[ep] = max(by[Category.ALL_GATHER_BUFFERS])
        sharded[ep] = max(by[Category.SHARDED_PARAMETERS])
    assert sharded[1] == sharded[2]
    one_layer_experts = 8 * (2 * 32 * 64 + 64 * 32) * 2  # experts x (gate_up + down), bf16
    assert gathered[1] - gathered[2] == one_layer_experts // 2


# -- against real processes -------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_prediction_matches_real_processes(world):
    """tp 2 and ep 2 (x FSDP2) on 2 processes; tp 4, and tp 2 x FSDP2 over dp 2, on 4."""
    check_against_real_runs(world, TENSOR_PARALLEL[world])


def test_measure_refuses_what_it_cannot_run():
    spec = TrainingSpec(model=LLAMA, tp=2, dp_shard=2, strategy="ddp", **TEXT)
    from vramledger.parallel.real import wrap_real

    with pytest.raises(InputError, match="DDP over a tensor"):
        wrap_real(resolve(spec).build_model("meta"), spec, "fp32")
