"""Read a DeepSpeed JSON config into the TrainingSpec fields it decides.

Read: ``zero_optimization.stage`` (0 -> zero0, DeepSpeed's engine without ZeRO; 1 -> zero1,
2 -> zero2, 3 -> zero3),
``zero_optimization.offload_optimizer.device`` and ``offload_param.device`` ("cpu"; "none"),
``bf16.enabled`` (bf16-master), ``fp16.enabled`` (fp16-master), ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, and ``train_batch_size`` (checked against the other two and the
world size). Under stages 0, 1 and 2, which run DeepSpeed's own engine
(``parallel/deepspeed_engine.py``), the ``zero_optimization`` keys that shape its buffers and steps
(bucket sizes, overlap, contiguous gradients, round robin, reduce-scatter) and gradient
clipping are given to the engine as they are (``deepspeed_engine.PASSED_ZERO_KEYS``). Other
accepted keys only tune speed or logging and are ignored (the ``optimizer`` section too: the
optimizer is ``--optimizer``); any other key is an error naming it, so a setting that changes
memory is never silently dropped.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from vramledger.inputs.config_flags import check_agrees
from vramledger.inputs.errors import InputError
from vramledger.inputs.jsonfile import read_json_object
from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.spec import TrainingSpec

STAGES = {0: "zero0", 1: "zero1", 2: "zero2", 3: "zero3"}
_IGNORED_TOP = {
    "steps_per_print",
    "wall_clock_breakdown",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "flops_profiler",
    "comms_logger",
    "dump_state",
    "seq_parallel_communication_data_type",
    "train_batch_size",
}
_KNOWN_TOP = {
    "zero_optimization",
    "bf16",
    "fp16",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_allow_untested_optimizer",
} | _IGNORED_TOP
_ZERO_KEYS = {
    "stage",
    "offload_optimizer",
    "offload_param",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "reduce_scatter",
    "reduce_bucket_size",
    "contiguous_gradients",
    "round_robin_gradients",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "load_from_fp32_weights",
    "memory_efficient_linear",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "mics_shard_size",
}
_OFFLOAD_KEYS = {
    "device",
    "pin_memory",
    "buffer_count",
    "fast_init",
    "ratio",
    "nvme_path",
    "buffer_size",
    "max_in_cpu",
}
_PRECISION_KEYS = {
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "immediate_grad_update",
}


def _check_keys(section: dict[str, Any], known: set[str], where: str) -> None:
    for key in section:
        if key not in known:
            raise InputError(
                f"DeepSpeed config key {where}{key!r} is not supported",
                hint="remove it, or describe the run with vramledger's own options",
            )


def _offload_device(zero: dict[str, Any], key: str) -> bool:
    section = zero.get(key)
    if section is None:
        return False
    if not isinstance(section, dict):
        raise InputError(f"DeepSpeed config zero_optimization.{key} must be an object")
    _check_keys(section, _OFFLOAD_KEYS, f"zero_optimization.{key}.")
    device = section.get("device", "none")
    if device == "nvme":
        raise InputError(
            f"DeepSpeed config zero_optimization.{key}.device 'nvme' is not supported",
            hint="use cpu offload",
        )
    if device not in ("cpu", "none"):
        raise InputError(f"DeepSpeed config zero_optimization.{key}.device {device!r} is unknown")
    return device == "cpu"


DEEPSPEED_HINT = "give the ds_config.json your DeepSpeed launch uses"


def read_deepspeed_config(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """The TrainingSpec fields a DeepSpeed config sets, and notes on what was read."""
    config = read_json_object(path, "DeepSpeed config", hint=DEEPSPEED_HINT)
    _check_keys(config, _KNOWN_TOP, "")
    fields: dict[str, Any] = {}
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise InputError("DeepSpeed config zero_optimization must be an object")
    _check_keys(zero, _ZERO_KEYS, "zero_optimization.")
    stage = zero.get("stage", 0)
    if stage not in STAGES:
        raise InputError(f"DeepSpeed config zero_optimization.stage {stage!r} is not 0, 1, 2 or 3")
    fields["strategy"] = STAGES[stage]
    optimizer, params = (
        _offload_device(zero, "offload_optimizer"),
        _offload_device(zero, "offload_param"),
    )
    # deepspeed/runtime/zero/config.py: offload_optimizer "Valid for ZeRO stage 1, 2, 3",
    # offload_param "Valid only with stage 3"
    for offloaded, key, lowest in (
        (optimizer, "offload_optimizer", 1),
        (params, "offload_param", 3),
    ):
        if offloaded and stage < lowest:
            raise InputError(
                f"DeepSpeed config zero_optimization.{key} is valid only with ZeRO stage "
                f"{lowest} or above, not stage {stage}",
                hint=f"set zero_optimization.stage to {lowest} or more, or remove {key}",
            )
    fields["offload"] = {
        (False, False): "none",
        (True, False): "optimizer",
        (False, True): "params",
        (True, True): "both",
    }[(optimizer, params)]
    for key, precision in (("bf16", "bf16-master"), ("fp16", "fp16-master")):
        section = config.get(key, {})
        if not isinstance(section, dict):
            raise InputError(f"DeepSpeed config {key} must be an object")
        _check_keys(section, _PRECISION_KEYS, f"{key}.")
        if section.get("enabled"):
            if "precision" in fields:
                raise InputError("DeepSpeed config enables both bf16 and fp16")
            fields["precision"] = precision
    for key, field in (
        ("train_micro_batch_size_per_gpu", "batch_size"),
        ("gradient_accumulation_steps", "grad_accum"),
    ):
        if key in config:
            if not isinstance(config[key], int) or config[key] <= 0:
                raise InputError(f"DeepSpeed config {key} must be a positive integer")
            fields[field] = config[key]
    notes: list[str] = [
        Note(
            Topic.INPUTS,
            f"from {Path(path).name}: " + ", ".join(f"{k}={v}" for k, v in fields.items()),
        )
    ]
    return fields, notes


def apply_deepspeed(spec: TrainingSpec) -> tuple[TrainingSpec, list[str]]:
    if spec.deepspeed is None:
        return spec, []
    fields, notes = read_deepspeed_config(spec.deepspeed)
    check_agrees(spec, fields, "DeepSpeed config", spec.deepspeed)
    config = read_json_object(spec.deepspeed, "DeepSpeed config", hint=DEEPSPEED_HINT)
    total = config.get("train_batch_size")
    updated = replace(spec, **fields)
    if isinstance(total, int):
        expected = updated.batch_size * updated.grad_accum * updated.world_size
        if total != expected:
            raise InputError(
                f"DeepSpeed config train_batch_size {total} is not micro-batch {updated.batch_size} x "
                f"gradient accumulation {updated.grad_accum} x world size {updated.world_size} = {expected}",
                hint="fix the config or pass --world-size",
            )
    return updated, notes
