"""Read an accelerate config (what ``accelerate config`` writes: YAML, or JSON) into the
TrainingSpec fields it decides. Modelled on accelerate 1.15 (``commands/config/config_args.py``,
``commands/launch.py``, ``utils/dataclasses.py: FullyShardedDataParallelPlugin``,
``utils/fsdp_utils.py: fsdp2_prepare_model``).

Read:

- ``distributed_type``: ``FSDP`` -> fsdp (``fsdp_config.fsdp_version`` must be 2: FSDP2 is
  what is traced), ``MULTI_GPU`` -> ddp, ``NO`` -> none;
- ``num_processes``: the total over all machines (accelerate launch runs
  ``num_processes // num_machines`` per machine) -> world_size;
- ``mixed_precision``: ``bf16`` -> bf16-master under FSDP (FSDP2's MixedPrecisionPolicy with
  accelerate's dtypes, ``parallel/fsdp_units.py: mixed_precision_policy``), bf16-mixed otherwise (accelerate's
  native autocast); ``fp16`` -> 16-mixed without FSDP; ``no`` -> fp32;
- ``use_cpu: true`` -> target cpu;
- ``fsdp_config``: ``fsdp_auto_wrap_policy`` ``TRANSFORMER_BASED_WRAP`` (the classes of
  ``fsdp_transformer_layer_cls_to_wrap``, else the model's ``_no_split_modules``) ->
  shard_modules; ``SIZE_BASED_WRAP`` (``fsdp_min_num_params``, default 10^8 as accelerate
  launch's) -> shard_min_params; ``NO_WRAP`` -> no policy units. ``fsdp_offload_params`` ->
  offload both (FSDP2's CPUOffloadPolicy); ``fsdp_reshard_after_forward`` ->
  reshard_after_forward; ``fsdp_activation_checkpointing`` -> checkpoint_modules of the wrapped
  classes. The model is then wrapped as accelerate wraps it (``parallel/fsdp_units.py``).

Keys that only affect launching, checkpoint files or loading are accepted and ignored; any
other key, or a setting that changes memory and is not modelled (FP8, tensor/context
parallelism, torch.compile, FSDP1, ignored modules, checkpoint offload), is an error naming it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from vramledger.inputs.config_flags import check_agrees
from vramledger.inputs.errors import InputError
from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.recipe import resolve
from vramledger.inputs.spec import TrainingSpec

ACCELERATE_MODELLED = "1.15"
"""The accelerate version whose config format and FSDP2 wrapping are modelled here."""
LAUNCH_MIN_NUM_PARAMS = 100_000_000
"""``accelerate launch --fsdp_min_num_params`` default, ``int(1e8)`` (commands/launch.py),
which the launcher passes to the plugin when the config does not set it."""

_IGNORED_TOP = {
    "compute_environment",
    "debug",
    "downcast_bf16",  # TPU only
    "enable_cpu_affinity",
    "gpu_ids",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "main_training_function",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "tpu_name",
    "tpu_zone",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_vm",
    "command_file",
    "commands",
    "mpirun_config",
}
_READ_TOP = {
    "distributed_type",
    "mixed_precision",
    "num_processes",
    "num_machines",
    "use_cpu",
    "fsdp_config",
}
_EMPTY_TOP = {
    "deepspeed_config": "give the DeepSpeed config file to --deepspeed",
    "megatron_lm_config": "Megatron-LM is not modelled",
    "fp8_config": "FP8 training is not modelled",
    "parallelism_config": "tensor, context and hybrid-shard parallelism are not modelled",
    "dynamo_config": "torch.compile changes which intermediates exist; it is not modelled",
}
"""Sections accelerate writes only when they are used; used, they change memory."""
_IGNORED_FSDP = {
    "fsdp_state_dict_type",  # checkpoint files
    "fsdp_cpu_ram_efficient_loading",  # loading, before the first step
    "fsdp_sync_module_states",  # FSDP1; obsolete in FSDP2
    "fsdp_use_orig_params",  # obsolete in FSDP2
    "fsdp_backward_prefetch",  # set to None for FSDP2 by the plugin
    "fsdp_forward_prefetch",  # read for FSDP1 only
}
_READ_FSDP = {
    "fsdp_version",
    "fsdp_auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params",
    "fsdp_offload_params",
    "fsdp_reshard_after_forward",
    "fsdp_activation_checkpointing",
    "fsdp_activation_checkpointing_offload",
    "fsdp_sharding_strategy",
    "fsdp_ignored_modules",
}
_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")
"""accelerate's ``str_to_bool``."""

HINT = "give the config file your accelerate launch uses (accelerate config writes it)"


def load_accelerate_config(path: str | Path) -> dict[str, Any]:
    """The config as accelerate loads it: JSON for a ``.json`` file, else YAML."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"accelerate config {path} not found", hint=HINT)
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    else:
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - PyYAML comes with transformers
            raise InputError(
                "reading a YAML accelerate config needs PyYAML", hint="pip install pyyaml"
            ) from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InputError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path} must hold a mapping of accelerate settings", hint=HINT)
    return data


def _refuse(key: str, why: str = "is not supported") -> InputError:
    return InputError(
        f"accelerate config key {key!r} {why}",
        hint="remove it, or describe the run with vramledger's own options",
    )


def _check_keys(section: dict[str, Any], known: set[str], where: str = "") -> None:
    for key in section:
        if key not in known:
            raise _refuse(where + key)


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise InputError(f"accelerate config {key} must be true or false, not {value!r}")


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"accelerate config {key} must be a positive integer, not {value!r}")
    return value


def _fsdp_section(config: dict[str, Any]) -> dict[str, Any]:
    """``fsdp_config`` with accelerate launch's key spelling (``x`` read as ``fsdp_x``)."""
    section = config.get("fsdp_config") or {}
    if not isinstance(section, dict):
        raise InputError("accelerate config fsdp_config must be a mapping")
    out = {}
    for key, value in section.items():
        out[key if key.startswith("fsdp") else "fsdp_" + key] = value
    return out


def read_accelerate_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The TrainingSpec fields an accelerate config sets, and what it says about the wrap policy
    (``policy``, ``classes``; resolved against the model by ``apply_accelerate``)."""
    config = load_accelerate_config(path)
    _check_keys(config, _READ_TOP | _IGNORED_TOP | set(_EMPTY_TOP))
    for key, why in _EMPTY_TOP.items():
        value = config.get(key)
        if key == "dynamo_config" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if str(v).upper() != "NO"}
        if value:
            raise _refuse(key, f"is set, and {why}")
    environment = config.get("compute_environment", "LOCAL_MACHINE")
    if environment != "LOCAL_MACHINE":
        raise _refuse("compute_environment", f"{environment!r} is not modelled (LOCAL_MACHINE is)")
    distributed = str(config.get("distributed_type", "")).upper()
    strategies = {"FSDP": "fsdp", "MULTI_GPU": "ddp", "NO": "none"}
    if distributed not in strategies:
        hint = {"DEEPSPEED": "pass its DeepSpeed config file with --deepspeed"}.get(
            distributed, "FSDP, MULTI_GPU and NO are modelled"
        )
        raise InputError(
            f"accelerate config distributed_type {config.get('distributed_type')!r} is not modelled",
            hint=hint,
        )
    fields: dict[str, Any] = {"strategy": strategies[distributed]}
    if "num_processes" in config and config["num_processes"] != -1:  # -1: not set
        processes = _positive_int(config["num_processes"], "num_processes")
        machines = _positive_int(config.get("num_machines", 1), "num_machines")
        if processes % machines:
            raise InputError(
                f"accelerate config num_processes {processes} (the total) is not a multiple of "
                f"num_machines {machines}"
            )
        fields["world_size"] = processes
    if _bool(config.get("use_cpu", False), "use_cpu"):
        fields["target"] = "cpu"
    fsdp = _fsdp_section(config)
    if distributed != "FSDP" and fsdp:
        raise _refuse("fsdp_config", f"is set, and distributed_type is {distributed}")
    if "mixed_precision" in config:  # absent: the spec's (accelerate launch's flag)
        precision = str(config["mixed_precision"] or "no").lower()
        fields["precision"] = _precision(precision, fsdp=distributed == "FSDP")
    wrap: dict[str, Any] = {"policy": None, "classes": None}
    if distributed == "FSDP":
        wrap = _read_fsdp(fsdp, fields)
    return fields, wrap


def _precision(name: str, *, fsdp: bool) -> str:
    if name == "no":
        return "fp32"
    if name == "bf16":
        return "bf16-master" if fsdp else "bf16-mixed"
    if name == "fp16":
        if fsdp:
            raise _refuse(
                "mixed_precision", "fp16 with FSDP (a GradScaler over FSDP2) is not modelled"
            )
        return "16-mixed"
    raise _refuse("mixed_precision", f"{name!r} is not modelled (no, bf16 and fp16 are)")


def _read_fsdp(fsdp: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    _check_keys(fsdp, _READ_FSDP | _IGNORED_FSDP, "fsdp_config.")
    version = fsdp.get("fsdp_version", 1)
    if str(version) != "2":
        raise InputError(
            f"accelerate config fsdp_config.fsdp_version {version!r} (FSDP1) is not modelled",
            hint="vramledger runs FSDP2: set fsdp_version: 2",
        )
    sharding = fsdp.get("fsdp_sharding_strategy")
    if sharding is not None and str(sharding).upper() not in ("FULL_SHARD", "1"):
        raise _refuse(
            "fsdp_config.fsdp_sharding_strategy",
            f"{sharding!r} is FSDP1's; FSDP2 takes fsdp_reshard_after_forward",
        )
    if fsdp.get("fsdp_ignored_modules"):
        raise _refuse(
            "fsdp_config.fsdp_ignored_modules", "is set, and ignored modules are not modelled"
        )
    if _bool(
        fsdp.get("fsdp_activation_checkpointing_offload", False),
        "fsdp_config.fsdp_activation_checkpointing_offload",
    ):
        raise _refuse(
            "fsdp_config.fsdp_activation_checkpointing_offload",
            "is true, and offloading checkpoint inputs is not modelled",
        )
    policy = str(fsdp.get("fsdp_auto_wrap_policy") or "NO_WRAP").upper()
    if policy not in _POLICIES:
        raise InputError(
            f"accelerate config fsdp_config.fsdp_auto_wrap_policy {policy!r} is unknown",
            hint=f"use one of {', '.join(_POLICIES)}",
        )
    classes = None
    if policy == "TRANSFORMER_BASED_WRAP":
        names = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            raise InputError(
                "accelerate config fsdp_config.fsdp_transformer_layer_cls_to_wrap must name classes"
            )
        classes = tuple(names) if names is not None else None
    elif policy == "SIZE_BASED_WRAP":
        minimum = fsdp.get("fsdp_min_num_params", LAUNCH_MIN_NUM_PARAMS)
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
            raise InputError(
                f"accelerate config fsdp_config.fsdp_min_num_params must be an integer, not {minimum!r}"
            )
        if minimum > 0:  # accelerate's set_auto_wrap_policy: "If zero, we silently ignore it."
            fields["shard_min_params"] = minimum
    if "fsdp_offload_params" in fsdp:
        offload = _bool(fsdp["fsdp_offload_params"], "fsdp_config.fsdp_offload_params")
        fields["offload"] = "both" if offload else "none"
    if "fsdp_reshard_after_forward" in fsdp:
        fields["reshard_after_forward"] = _bool(
            fsdp["fsdp_reshard_after_forward"], "fsdp_config.fsdp_reshard_after_forward"
        )
    checkpointing = _bool(
        fsdp.get("fsdp_activation_checkpointing", False),
        "fsdp_config.fsdp_activation_checkpointing",
    )
    if checkpointing and policy != "TRANSFORMER_BASED_WRAP":
        raise _refuse(
            "fsdp_config.fsdp_activation_checkpointing",
            f"with {policy} is not modelled (accelerate checkpoints the wrap policy's modules; "
            "TRANSFORMER_BASED_WRAP names them)",
        )
    return {"policy": policy, "classes": classes, "checkpointing": checkpointing}


def apply_accelerate(spec: TrainingSpec) -> tuple[TrainingSpec, list[str]]:
    """``spec`` with the fields its accelerate config sets, and notes on what was read."""
    if spec.accelerate_config is None:
        return spec, []
    if spec.deepspeed is not None:
        raise InputError("give --accelerate-config or --deepspeed, not both")
    fields, wrap = read_accelerate_config(spec.accelerate_config)
    # FSDP units are checked together below (by class or by size, one place or the other)
    given = {k: v for k, v in fields.items() if k != "shard_min_params"}
    check_agrees(spec, given, "accelerate config", spec.accelerate_config)
    if wrap["policy"] == "TRANSFORMER_BASED_WRAP":
        classes = wrap["classes"]
        if classes is None:  # accelerate's default: the model's own _no_split_modules
            model = resolve(spec).build_model("meta")
            classes = tuple(getattr(model, "_no_split_modules", None) or ())
        fields["shard_modules"] = classes
        if wrap["checkpointing"]:
            fields["checkpoint_modules"] = tuple(
                dict.fromkeys((*spec.checkpoint_modules, *classes))
            )
    if wrap["policy"] is not None:  # FSDP: the file's policy names the units
        units = (
            fields.setdefault("shard_modules", ()),
            fields.setdefault("shard_min_params", None),
        )
        if (spec.shard_modules, spec.shard_min_params) not in (((), None), units):
            raise InputError(
                f"the accelerate config's {wrap['policy']} names the FSDP units, and so do "
                "--shard-modules/--shard-min-params",
                hint="give the units in one place",
            )
    updated = replace(spec, **fields)
    if not updated.parallelism.is_fsdp and (
        spec.shard_modules
        or spec.shard_min_params is not None
        or spec.reshard_after_forward is not None
    ):
        raise InputError(
            f"FSDP units are set, and the accelerate config's distributed_type makes the strategy "
            f"{updated.strategy}"
        )
    read = ", ".join(f"{k}={v}" for k, v in fields.items())
    notes = [
        f"from {Path(spec.accelerate_config).name}: {read}; wrapped as accelerate "
        f"{ACCELERATE_MODELLED} wraps FSDP2"
    ]
    if updated.parallelism.is_fsdp and updated.precision == "bf16-master":
        notes.append(
            "accelerate bf16 under FSDP2: MixedPrecisionPolicy(param, reduce and output dtype "
            "bf16); accelerate's autocast around the forward is not traced (parameters are "
            "already bf16; operators autocast runs in fp32 are not)"
        )
    return updated, [Note(Topic.INPUTS, n) for n in notes]
