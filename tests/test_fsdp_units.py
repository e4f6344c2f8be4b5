"""Named FSDP2 units (--shard-modules, --shard-min-params), reshard_after_forward, and accelerate
FSDP configs: the units chosen, against real multi-process gloo runs that wrap the same units
(each rank's peak counted by the CPU allocator, ``tests/mesh_real.py``: one run, no retries)
and against accelerate's own ``fsdp2_prepare_model``."""

import types
from dataclasses import replace

import pytest
import torch

from vramledger import estimate
from vramledger.inputs.accelerate_config import apply_accelerate, read_accelerate_config
from vramledger.inputs.errors import InputError
from vramledger.inputs.recipe import resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.parallel.fsdp_units import apply_fully_shard, check_units_are_blocks, shard_units
from vramledger.trace.core.blocks import NotExtensible

from .conftest import FIXTURES, MODELS_PY, fixture
from .mesh_real import DATA_PARALLEL, LINEARS, check_against_real_runs

ACCELERATE = FIXTURES / "accelerate"


def _per_rank(world: int, spec: dict) -> dict[int, int]:
    predicted = estimate(world_size=world, strategy="fsdp", **spec)
    return {r: ledger.peak_bytes for ids, ledger in predicted.ranks for r in ids}


def _meta_model(**fields):
    spec = TrainingSpec(world_size=2, strategy="fsdp", **{**LINEARS, **fields})
    return spec, resolve(spec).build_model("meta")


# -- which modules are units ------------------------------------------------------------------
def test_shard_modules_picks_every_linear_children_first():
    spec, model = _meta_model()
    units, words = shard_units(model, spec)
    assert [u.modules[0] for u in units] == [m for m in model if isinstance(m, torch.nn.Linear)]
    assert "Linear" in words
    with pytest.raises(InputError, match="no submodule of class Conv2d"):
        shard_units(
            model, TrainingSpec(**{**LINEARS, "shard_modules": ("Conv2d",)}, strategy="fsdp")
        )


def test_units_that_are_not_the_blocks_fall_back_to_a_full_trace():
    """deep_mlp has 8 identical blocks; a trace of 4 and 5 extends only when the blocks are the
    units."""
    spec = {**LINEARS, "model": f"{MODELS_PY}:deep_mlp"}
    blocks = estimate(world_size=2, strategy="fsdp", **{**spec, "shard_modules": ("Block",)})
    assert any("extended the timeline" in n for n in blocks.notes)
    linears = estimate(world_size=2, strategy="fsdp", **spec)
    assert any("FSDP units are not the blocks" in n for n in linears.notes)
    _, model = _meta_model(model=f"{MODELS_PY}:deep_mlp")
    stack = list(model.blocks)
    units, _ = shard_units(model, TrainingSpec(**spec, strategy="fsdp"))
    with pytest.raises(NotExtensible):
        check_units_are_blocks(units, stack)


def test_spec_refuses_units_without_fsdp():
    with pytest.raises(InputError, match="the strategy is none"):
        TrainingSpec(**LINEARS)
    with pytest.raises(InputError, match="divisor of the world size 4"):
        TrainingSpec(**LINEARS, world_size=4, strategy="fsdp", reshard_after_forward=3)


def test_cli_maps_the_options_onto_the_spec():
    from vramledger.cli import build_parser, spec_from_args

    args = build_parser().parse_args(
        ["estimate", "m.py:f", "--world-size", "4", "--strategy", "fsdp", "--shard-modules",
         "Linear,Block", "--shard-modules", "Norm", "--reshard-after-forward", "2"]
    )  # fmt: skip
    spec = spec_from_args(args)
    assert spec.shard_modules == ("Linear", "Block", "Norm")
    assert spec.reshard_after_forward == 2
    args = build_parser().parse_args(
        ["estimate", "m.py:f", "--strategy", "fsdp", "--reshard-after-forward", "False"]
    )
    assert spec_from_args(args).reshard_after_forward is False


# -- against real processes -------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_shard_modules_linear_matches_real_processes(world):
    """Without --shard-modules only the root is a unit here (no ModuleList of blocks) and the
    estimate is 42 % above these runs."""
    check_against_real_runs(world, {"fsdp-linear-units": DATA_PARALLEL[world]["fsdp-linear-units"]})


def test_reshard_after_forward_orders_memory_as_fsdp2_does():
    """False keeps every unit's gathered parameters from its forward to its backward; an
    integer N keeps a copy sharded over N ranks: between the two."""
    peaks = {
        r: estimate(world_size=4, strategy="fsdp", **LINEARS, reshard_after_forward=r)
        for r in (True, 2, False)
    }
    assert peaks[True].peak_bytes < peaks[2].peak_bytes < peaks[False].peak_bytes
    assert peaks[False].phases[peaks[False].peak_phase] == peaks[False].peak_bytes
    default = estimate(world_size=4, strategy="fsdp", **LINEARS)
    assert default.peak_bytes == peaks[True].peak_bytes  # FSDP2's default for non-root units


@pytest.mark.multiprocess
def test_reshard_after_forward_false_matches_real_processes():
    case = "fsdp-linear-units-keep"
    spec = DATA_PARALLEL[2][case]
    assert spec["reshard_after_forward"] is False
    want = _per_rank(2, {**LINEARS, "reshard_after_forward": False})
    assert all(w > p for w, p in zip(want.values(), _per_rank(2, LINEARS).values(), strict=True))
    check_against_real_runs(2, {case: spec})


@pytest.mark.multiprocess
def test_accelerate_layout_matches_real_processes():
    """An HF model wrapped as accelerate wraps it (decoder layers, the input embedding, the final
    norm and head as one group kept after forward, the root), bf16 with accelerate's dtypes and
    checkpointed layers."""
    check_against_real_runs(2, {"fsdp-accelerate": DATA_PARALLEL[2]["fsdp-accelerate"]})


# -- accelerate configs -----------------------------------------------------------------------
def test_accelerate_yaml_is_read_into_the_spec():
    spec, notes = apply_accelerate(
        TrainingSpec(**{**LINEARS, "shard_modules": ()}, accelerate_config=str(ACCELERATE / "fsdp2-linear.yaml"))
    )  # fmt: skip
    assert (spec.strategy, spec.world_size, spec.precision, spec.offload) == (
        "fsdp",
        2,
        "fp32",
        "none",
    )
    assert (spec.shard_modules, spec.reshard_after_forward) == (("Linear",), True)
    assert "fsdp2-linear.yaml" in notes[0]
    assert apply_accelerate(spec)[0] == spec  # read again (measure --compare): the same
    with pytest.raises(InputError, match="names the FSDP units"):
        apply_accelerate(replace(spec, shard_modules=("ReLU",)))
    llama, _ = apply_accelerate(
        TrainingSpec(model=fixture("tiny-llama.json"), accelerate_config=str(ACCELERATE / "fsdp2-llama-bf16.yaml"))
    )  # fmt: skip
    assert llama.precision == "bf16-master"
    assert (
        llama.shard_modules == llama.checkpoint_modules == ("LlamaDecoderLayer",)
    )  # _no_split_modules


def test_accelerate_bad_key_is_refused_in_one_line(tmp_path, capsys):
    from vramledger.cli import main

    with pytest.raises(InputError) as info:
        read_accelerate_config(ACCELERATE / "bad-key.yaml")
    assert "fsdp_config.fsdp_min_num_parameters" in info.value.one_line()
    code = main(
        ["estimate", LINEARS["model"], "--accelerate-config", str(ACCELERATE / "bad-key.yaml")]
    )
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "fsdp_min_num_parameters" in err


@pytest.mark.parametrize(
    ("edits", "expect"),
    [
        ({"fsdp_version: 2": "fsdp_version: 1"}, "FSDP1"),
        ({"fsdp_offload_params: false": "fsdp_offload_params: true"}, {"offload": "both"}),
        ({"mixed_precision: 'no'": "mixed_precision: fp8"}, "not modelled"),
        ({"num_machines: 1": "num_machines: 2"}, {"world_size": 2}),  # num_processes is the total
        ({"TRANSFORMER_BASED_WRAP": "SIZE_BASED_WRAP"}, {"shard_min_params": 100_000_000}),
        (  # accelerate's set_auto_wrap_policy ignores a minimum of 0
            {"TRANSFORMER_BASED_WRAP": "SIZE_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap: Linear": "fsdp_min_num_params: 0"},
            {"shard_min_params": None},
        ),
        ({"distributed_type: FSDP": "distributed_type: DEEPSPEED"}, "--deepspeed"),
        ({"tpu_env: []": "tpu_env: []\nparallelism_config:\n  parallelism_config_tp_size: 2"}, "parallelism"),
        ({"fsdp_version: 2": "fsdp_version: 2\n  activation_checkpointing_offload: true"}, "offloading"),
    ],
)  # fmt: skip
def test_accelerate_settings(tmp_path, edits, expect):
    text = (ACCELERATE / "fsdp2-linear.yaml").read_text()
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    if isinstance(expect, str):
        with pytest.raises(InputError) as info:
            read_accelerate_config(path)
        assert expect in info.value.one_line()
        return
    fields, _ = read_accelerate_config(path)
    for key, value in expect.items():
        assert fields.get(key) == value


@pytest.mark.parametrize(
    ("model", "plugin", "fields"),
    [
        ("tiny-llama.json", {"auto_wrap_policy": "transformer_based_wrap"}, {}),
        ("tiny-gpt2.json", {"auto_wrap_policy": "transformer_based_wrap"}, {}),  # tied
        ("tiny-llama.json", {"auto_wrap_policy": "no_wrap", "reshard_after_forward": False}, {}),
        ("tiny-llama.json", {"auto_wrap_policy": "size_based_wrap", "min_num_params": 300_000}, {"shard_min_params": 300_000}),
        ("models.py:linear_stack", {"auto_wrap_policy": "size_based_wrap", "min_num_params": 1000}, {"shard_min_params": 1000}),
    ],
)  # fmt: skip
def test_units_are_the_ones_accelerate_makes(model, plugin, fields):
    """accelerate's own fsdp2_prepare_model and ours, each on a meta copy of the model under a
    fake process group: the same fully_shard calls, in order, with the same resharding."""
    pytest.importorskip("accelerate")
    import torch.distributed.fsdp as fsdp
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from vramledger.parallel.engines import fake_world

    source = dict(model=fixture(model), seq_len=32)
    if model.startswith("models.py"):
        source = dict(model=f"{MODELS_PY}:{model.split(':')[1]}", inputs=LINEARS["inputs"])
    reshard = plugin.get("reshard_after_forward")
    if reshard is not None:
        fields = {**fields, "reshard_after_forward": reshard}
    if plugin["auto_wrap_policy"] == "transformer_based_wrap":
        spec = TrainingSpec(**source, strategy="fsdp", accelerate_config="x.yaml")
        fields = {**fields, "shard_modules": resolve(spec).build_model("meta")._no_split_modules}
    spec = TrainingSpec(
        **source, world_size=2, strategy="fsdp", accelerate_config="x.yaml", **fields
    )

    def calls(run):
        model = resolve(spec).build_model("meta")
        names = {id(m): n for n, m in model.named_modules()}
        made = []
        real = fsdp.fully_shard

        def recording(module, **kwargs):
            group = module if isinstance(module, list) else [module]
            # accelerate passes its reshard_after_forward (True) where FSDP2's default is True
            how = kwargs.get("reshard_after_forward")
            made.append(
                (
                    tuple(names[id(m)] for m in group),
                    True if how is None and names[id(group[0])] else how,
                )
            )
            return real(module, **{**kwargs, "mesh": mesh})

        fsdp.fully_shard = recording
        try:
            run(model)
        finally:
            fsdp.fully_shard = real
        return made

    def accelerate(model):
        state = types.SimpleNamespace(
            fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, **plugin)
        )
        accelerator = types.SimpleNamespace(
            state=state, mixed_precision="no", is_main_process=True, device=torch.device("cpu")
        )
        fsdp2_prepare_model(accelerator, model)

    with fake_world(0, 2) as mesh:
        theirs = calls(accelerate)
        ours = calls(lambda model: apply_fully_shard(model, spec, mesh, "fp32"))
    assert ours == theirs
    assert len(ours) > 1


def test_size_policy_refuses_what_fsdp2_cannot_wrap():
    """accelerate's SIZE_BASED_WRAP picks a ModuleList of layers, which fully_shard refuses."""
    spec = TrainingSpec(
        model=fixture("tiny-llama.json"), world_size=2, strategy="fsdp", shard_min_params=1000
    )
    with pytest.raises(InputError, match=r"model\.layers"):
        estimate(spec)
