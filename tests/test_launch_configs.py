"""The launch's config files (``--deepspeed``, ``--accelerate-config``) are read into the spec
once (``launch_configs.py``): what fit, plan and advise vary afterwards keeps its value."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vramledger import TrainingSpec, estimate
from vramledger.cli import main
from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import resolve_gpu
from vramledger.inputs.launch_configs import apply_configs
from vramledger.plan.fit import fit

from .conftest import fixture

DS_STAGE0_BF16 = str(Path(__file__).parent / "library_loops" / "ds_bf16.json")
"""DeepSpeed without ZeRO, bf16, ``train_micro_batch_size_per_gpu`` 8."""


def test_config_read_once_and_variants_keep_their_values():
    spec = TrainingSpec(model=fixture("tiny-llama.json"), seq_len=16, deepspeed=DS_STAGE0_BF16)
    read, notes = apply_configs(spec)
    assert read.configs_applied and not spec.configs_applied
    assert (read.strategy, read.precision, read.batch_size) == ("zero0", "bf16-master", 8)
    assert any("ds_bf16.json" in n for n in notes)
    # read again: the same spec, the same notes
    assert apply_configs(read) == (read, notes)
    # a variant keeps its micro-batch (read again, the config set it back to 8)
    variant = replace(read, batch_size=3)
    assert apply_configs(variant)[0].batch_size == 3


@pytest.mark.slow
def test_fit_varies_the_micro_batch_of_a_deepspeed_launch():
    """``fit --deepspeed`` answered 1,048,576: each size it tried was read back to the config's
    micro-batch (8), which fitted every time."""
    pytest.importorskip("deepspeed")
    spec = TrainingSpec(model=fixture("tiny-llama.json"), seq_len=32, deepspeed=DS_STAGE0_BF16)
    gpu = resolve_gpu(memory="120MiB")
    result = fit(spec, gpu, checkpointing=(False,), margin=0, workers=1)
    (answer,) = result.answers
    assert not answer.fits_next

    def reserved(batch_size: int) -> int:
        variant = replace(apply_configs(spec)[0], batch_size=batch_size, gpu=gpu, margin=0)
        ledger = estimate(variant)
        assert ledger.spec["batch_size"] == batch_size
        return ledger.reserved_peak_bytes

    assert reserved(answer.batch_size) == answer.reserved_peak_bytes <= gpu.memory_bytes
    assert reserved(answer.batch_size + 1) > gpu.memory_bytes


def test_a_flag_the_config_sets_otherwise_is_refused(capsys):
    """``--batch-size 3`` with a config whose micro-batch is 8 was answered for 8, silently (the
    note named the config's value, not the flag it replaced); the same value both ways, or the
    flag left at its default, is the config's."""
    spec = TrainingSpec(model=fixture("tiny-llama.json"), seq_len=16, deepspeed=DS_STAGE0_BF16)
    for conflict, option in (
        (dict(batch_size=3), "--batch-size 3"),
        (dict(precision="bf16-mixed"), "--precision bf16-mixed"),
        (dict(strategy="zero2"), "--strategy zero2"),
    ):
        with pytest.raises(InputError, match=f"{option} but the DeepSpeed config ds_bf16.json"):
            apply_configs(replace(spec, **conflict))
    agreed = apply_configs(replace(spec, batch_size=8, precision="bf16-master"))[0]
    assert (agreed.batch_size, agreed.precision, agreed.strategy) == (8, "bf16-master", "zero0")
    # on the command line: one line, exit 2, no traceback
    code = main(["estimate", fixture("tiny-llama.json"), "--seq-len", "16", "--batch-size", "3",
                 "--deepspeed", DS_STAGE0_BF16])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--batch-size 3 but the DeepSpeed config ds_bf16.json sets batch_size 8" in err


def test_a_flag_the_accelerate_config_sets_otherwise_is_refused():
    """The same for ``--accelerate-config``: its ``mixed_precision: bf16`` under FSDP is
    bf16-master, and ``--precision 16-mixed`` beside it was dropped silently."""
    accelerate = fixture("accelerate/fsdp2-llama-bf16.yaml")
    spec = TrainingSpec(model=fixture("tiny-llama.json"), seq_len=16, accelerate_config=accelerate)
    with pytest.raises(InputError, match="--precision 16-mixed but the accelerate config"):
        apply_configs(replace(spec, precision="16-mixed"))
    with pytest.raises(InputError, match="--offload optimizer but the accelerate config"):
        apply_configs(replace(spec, offload="optimizer"))
    with pytest.raises(InputError, match="--world-size 4 but the accelerate config"):
        apply_configs(replace(spec, world_size=4, strategy="ddp"))  # its num_processes is 2
    read = apply_configs(replace(spec, precision="bf16-master"))[0]
    assert (read.precision, read.strategy, read.world_size) == ("bf16-master", "fsdp", 2)
