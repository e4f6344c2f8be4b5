"""Parallelism: what each strategy name means, asked as properties; and no module under src/
compares a strategy with a name any more."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from vramledger.inputs.errors import InputError
from vramledger.inputs.parallelism import STRATEGIES, Parallelism, engine_of
from vramledger.inputs.spec import TrainingSpec

SRC = Path(__file__).resolve().parents[1] / "src" / "vramledger"

# What each strategy is (the table in parallelism.py's docstring), one row per name.
EXPECTED = {
    #              single ddp   fsdp   deepspeed stage zero-red. params grads  optimizer
    "none": (True, False, False, False, None, False, False, False, False),
    "ddp": (False, True, False, False, None, False, False, False, False),
    "zero1": (False, False, False, True, 1, False, False, False, True),
    "zero2": (False, False, False, True, 2, False, False, True, True),
    "zero3": (False, False, False, True, 3, False, True, True, True),
    "fsdp": (False, False, True, False, None, False, True, True, True),
    "zero1-torch": (False, True, False, False, None, True, False, False, True),
    "zero0": (False, False, False, True, 0, False, False, False, False),
}


def test_every_strategy_has_a_row():
    assert set(EXPECTED) == set(STRATEGIES)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_properties(strategy):
    p = Parallelism(strategy=strategy)
    single, ddp, fsdp, deepspeed, stage, zero_redundancy, params, grads, optimizer = EXPECTED[
        strategy
    ]
    assert p.name == strategy
    assert p.is_single is single
    assert p.is_data_parallel is not single
    assert p.is_ddp is ddp
    assert p.is_fsdp is fsdp
    assert p.is_deepspeed is deepspeed
    assert p.deepspeed_stage == stage
    assert p.is_zero_redundancy is zero_redundancy
    assert p.shards_params is params
    assert p.dp_shard_enabled is fsdp  # FSDP2's mesh axis, not DeepSpeed ZeRO-3's partition
    assert p.shards_grads is grads
    assert p.shards_optimizer_state is optimizer
    # ZeRO-1/2 and ZeroRedundancyOptimizer split the optimizer while parameters stay whole
    assert p.partitions_optimizer is (optimizer and not params)
    assert p.is_deepspeed_zero is (deepspeed and stage != 0)
    assert p.is_deepspeed_zero3 is (stage == 3)
    # a split model is modelled under DDP and FSDP2 only, not under DeepSpeed's engine
    assert p.models_split_model is not (p.partitions_optimizer or deepspeed)
    # identical blocks extend where a rank's blocks are alike and no DeepSpeed engine runs
    assert p.extends_blocks is not (p.partitions_optimizer or deepspeed)
    # only DeepSpeed ZeRO-1/2's flat partition makes the events depend on the rank (ZeRO-3
    # slices each parameter evenly)
    assert p.rank_independent is not (p.is_deepspeed_zero and not params)
    # the advice's ladder: ddp (or DeepSpeed without ZeRO) -> zero1 -> zero2, and ZeRO-3 after
    assert p.next_deepspeed_strategy == {"ddp": "zero1", "zero0": "zero1", "zero1": "zero2"}.get(
        strategy
    )
    assert p.upgrades_to_zero3 is (strategy in ("ddp", "zero0", "zero1", "zero2"))
    # exactly one engine runs each data-parallel strategy
    assert single or [ddp, fsdp, deepspeed].count(True) == 1
    assert p.engine == ENGINES[strategy] == engine_of(strategy)


ENGINES = {
    "none": "none",
    "ddp": "ddp",
    "zero0": "deepspeed",
    "zero1": "deepspeed",
    "zero2": "deepspeed",
    "zero3": "deepspeed",
    "fsdp": "fsdp2",
    "zero1-torch": "zero-redundancy-optimizer",
}
"""The JSON ``engine`` of each strategy: one vocabulary, zero0..zero3 DeepSpeed's, fsdp FSDP2's."""


def test_a_programs_strategies_name_their_data_parallel_engine():
    """``run``'s strategy joins what the program set up; tensor and pipeline parallelism are no
    data-parallel engine."""
    assert engine_of("tp+fsdp") == "fsdp2"
    assert engine_of("pp+zero3") == "deepspeed"
    assert engine_of("tp") == engine_of("none") == "none"


def test_zero3_with_a_split_model_is_refused_naming_fsdp():
    with pytest.raises(InputError, match="not modelled") as info:
        TrainingSpec(model="m", world_size=4, tp=2, strategy="zero3")
    assert "fsdp" in str(info.value.hint)


def test_none_reads_as_one_rank():
    assert Parallelism(strategy=None) == Parallelism(strategy=None)
    assert Parallelism(strategy=None).is_single
    assert Parallelism(strategy=None).name == "none"


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown strategy"):
        Parallelism(strategy="zero4")


def test_axes():
    p = Parallelism(strategy="fsdp", world_size=16, tp=2, pp=2, cp=1, offload="optimizer")
    assert p.model_split == 4
    assert p.data_parallel_degree == 4
    assert p.offloads
    assert not Parallelism().offloads


@pytest.mark.parametrize(
    ("fields", "strategy"),
    [
        ({}, "none"),
        ({"world_size": 4}, "ddp"),
        ({"world_size": 4, "strategy": "zero2"}, "zero2"),
        ({"dp_shard": 2, "tp": 2}, "fsdp"),
        ({"world_size": 2, "cp": 2}, "fsdp"),
    ],
)
def test_spec_parallelism(fields, strategy):
    spec = TrainingSpec(model="gpt2", **fields)
    p = spec.parallelism
    assert p.name == spec.strategy == strategy
    assert (p.world_size, p.tp, p.pp, p.cp, p.ep) == (
        spec.world_size,
        spec.tp,
        spec.pp,
        spec.cp,
        spec.ep,
    )
    assert p.data_parallel_degree == spec.dp_degree
    assert p.model_split == spec.model_split


@pytest.mark.parametrize(
    ("given", "resolved"),
    [
        ({}, ("none", 1)),
        ({"world_size": 8}, ("ddp", 8)),
        ({"nodes": 2, "gpus_per_node": 8}, ("ddp", 16)),
        ({"nodes": 2, "gpus_per_node": 8, "world_size": 16, "strategy": "zero3"}, ("zero3", 16)),
        ({"dp_shard": 4, "tp": 2}, ("fsdp", 8)),
        ({"tp": 2, "pp": 2}, ("none", 4)),
        ({"world_size": 4, "cp": 2}, ("fsdp", 4)),
        ({"world_size": 4, "ep": 4}, ("fsdp", 4)),
    ],
)
def test_the_parallel_section_resolves_itself(given, resolved):
    """``Parallelism.resolve`` checks the parallel options and makes the world size and the
    default strategy from them, with no spec around it; the spec keeps what it resolved."""
    taken = inspect.signature(Parallelism.resolve).parameters
    options = {f.name: f.default for f in dataclasses.fields(TrainingSpec) if f.name in taken}
    assert set(options) == set(taken)  # the spec's defaults for every option resolve takes
    p = Parallelism.resolve(**{**options, **given})
    assert (p.name, p.world_size) == resolved
    spec = TrainingSpec(model="gpt2", **given)
    assert spec.parallelism == p and spec.parallelism is spec.parallelism  # resolved once
    assert (spec.strategy, spec.world_size) == (p.strategy, p.world_size)


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"world_size": 0}, "world-size must be a positive integer, not 0"),
        ({"world_size": 2**17 + 1}, "world-size 131,073 is beyond any training cluster"),
        ({"nodes": 2}, "give --nodes and --gpus-per-node together"),
        ({"nodes": 2, "gpus_per_node": 4, "world_size": 6}, "not nodes x gpus-per-node = 8"),
        ({"tp": True}, "tp must be a positive integer, not True"),
        ({"dp_shard": 2, "tp": 2, "world_size": 8}, "not dp-shard x tp x pp x cp = 4"),
        ({"world_size": 6, "tp": 4}, "not a multiple of tp x pp x cp = 4"),
        ({"world_size": 4, "ep": 3}, "ep 3 does not divide"),
        ({"world_size": 4, "strategy": "zero4"}, "unknown strategy 'zero4'"),
        ({"world_size": 4, "strategy": "none"}, "world-size 4 needs a --strategy"),
        ({"offload": "disk"}, "unknown offload 'disk'"),
    ],
)
def test_the_parallel_section_refuses_in_one_line(given, words):
    with pytest.raises(InputError, match=re.escape(words)):
        TrainingSpec(model="gpt2", **given)


def test_spec_refuses_what_parallelism_says_is_not_modelled():
    with pytest.raises(InputError, match="not modelled"):
        TrainingSpec(model="gpt2", world_size=4, tp=2, strategy="zero1")
    with pytest.raises(InputError, match="set FSDP units"):
        TrainingSpec(model="gpt2", world_size=2, strategy="ddp", shard_min_params=10)


DEFINED_IN = "inputs/parallelism.py"
"""The one module that knows what each strategy name means, and checks the user's
``--strategy`` is one (``Parallelism.resolve``)."""
VALIDATION: set[tuple[str, str]] = set()
"""Comparisons elsewhere allowed: none."""


def _mentions_strategy(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return "strateg" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "strateg" in node.attr.lower()
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and "strateg" in str(key.value).lower()
    if isinstance(node, ast.BoolOp):
        return any(_mentions_strategy(v) for v in node.values)
    return False


def _names(node: ast.AST) -> bool:
    """A string literal, a tuple/set/list of them, or a ``*_STRATEGIES`` set of names."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.Tuple | ast.Set | ast.List):
        return any(_names(e) for e in node.elts)
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return name.endswith("STRATEGIES")
    if isinstance(node, ast.BinOp):
        return _names(node.left) or _names(node.right)
    return False


def test_no_module_compares_a_strategy_with_a_name():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where == DEFINED_IN:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if (where, ast.unparse(node)) in VALIDATION:
                continue
            if any(_mentions_strategy(s) for s in sides) and any(_names(s) for s in sides):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "ask spec.parallelism (parallelism.py) instead:\n" + "\n".join(found)


def test_zero3_estimate_runs_deepspeeds_stage3_and_says_so():
    """``estimate --strategy zero3`` traces DeepSpeed's ZeRO-3 engine (its flat bf16 shard, fp32
    partition, gradient slices), one rank standing for both; ``fsdp`` is FSDP2; the JSON's
    ``engine`` says which, beside the unchanged ``strategy``."""
    pytest.importorskip("deepspeed")
    from vramledger import estimate

    from .conftest import fixture

    fields = dict(model=fixture("tiny-llama.json"), seq_len=32, world_size=2, target="cpu")
    zero3 = estimate(strategy="zero3", precision="bf16-master", **fields).to_dict()
    assert (zero3["strategy"], zero3["engine"]) == ("zero3", "deepspeed")
    assert any("DeepSpeedZeroOptimizer_Stage3" in note for note in zero3["notes"])
    assert [r["rank_ids"] for r in zero3["ranks"]] == [[0, 1]]
    at_peak = zero3["at_peak"]
    assert at_peak["parameters"] == 0
    assert at_peak["master_weights"] == 2 * at_peak["sharded_parameters"] > 0
    assert at_peak["sharded_gradients"] > 0
    fsdp = estimate(strategy="fsdp", **fields).to_dict()
    assert (fsdp["strategy"], fsdp["engine"]) == ("fsdp", "fsdp2")
    assert not any("DeepSpeed" in note for note in fsdp["notes"])
