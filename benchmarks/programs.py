"""`vramledger run` on users' own programs, against the same programs run for real on CPU.

    python benchmarks/programs.py            # every program, a few minutes on 2 cores
    python benchmarks/programs.py --quick    # the first 4

Each program (tests/programs/, ordinary scripts that run unchanged with plain `python` on a CUDA
machine; nanoGPT's own train.py on a tiny config and local data, where ``VRAMLEDGER_NANOGPT``
names a checkout of karpathy/nanoGPT, which is not shipped here; LitGPT's `finetune_lora`,
`finetune_full` and `pretrain` on a tiny checkpoint and local data; torchtune's `tune run
lora_finetune_single_device` on a tiny checkpoint in Hugging Face's and Meta's formats, and its
LoRA, QLoRA and full recipes with the configs its wheel ships; torchtitan 0.2's `-m
torchtitan.train` with its llama3 debug model as two FSDP2 ranks; the frameworks come with the
``frameworks`` extra) runs three times, each in its own process: `vramledger run --target cpu`
(the prediction of what the CPU allocator counts), `vramledger run --measure` (the real CPU run,
counted by `cpu_allocator_count`) and `vramledger run --gpu h100-80gb` (the CUDA prediction, for
reference). The table compares each optimizer's steady peak; the host tensors the prediction
names (``host_bytes``: memory the real CPU run's allocator counts and a GPU's would not see) are
shown beside the difference, and a row is unexplained when the difference less them is beyond
0.5 % of the measured peak. Results are written to
benchmarks/results/programs-<date>-<host>-<commit>.json (``--out``) with the date, commit and
machine; ``--compare`` an earlier one (``benchkit/compare.py``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchkit import compare, provenance
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
PROGRAMS = HERE.parent / "tests" / "programs"

CASES = [
    "sgd_then_adam",
    "gan",
    "ema",
    "distill",
    "autocast_bf16",
    "device_of_input",
    "custom_function_device",
    "accelerate_ema",
    "default_device",
    "cuda_timing",
    "compiled_autocast",
    "grad_scaler",
    "data_loader",
    "bnb_layers",
    "hf_llama",
    "hf_trainer",
    "lightning_bf16_mixed",
    "lightning_bf16_true",
    "trl_sft",
    "trl_dpo",
    "nanogpt",
    "litgpt_finetune_lora",
    "litgpt_finetune_full",
    "litgpt_pretrain",
    "torchtune_lora_hf",
    "torchtune_lora_meta",
    "torchtune_recipe_lora_compile_ac_offload",
    "torchtune_recipe_qlora",
    "torchtune_recipe_full",
    "torchtitan_debugmodel_2ranks",
    "lightning_logging",
    "accelerator_device",
]
HOST = {
    "data_loader": "the TensorDataset in host memory (33,792 B)",
    "hf_trainer": "the next batch accelerate's DataLoaderShard fetches on the host (2,048 B) "
    "and Trainer's host scalars",
    "nanogpt": "the two mean losses estimate_loss keeps on the host (8 B)",
    "trl_sft": "activation checkpointing's saved CPU RNG states (2 x 5,056 B), the next batch "
    "accelerate's DataLoaderShard fetches on the host (2,352 B) and Trainer's host scalars",
    "trl_dpo": "activation checkpointing's saved CPU RNG states (2 x 5,056 B), the next batch "
    "accelerate's DataLoaderShard fetches on the host (3,840 B) and Trainer's host scalars",
    "lightning_bf16_mixed": "the TensorDataset in host memory (32,768 B) and Lightning's host "
    "scalars",
    "lightning_bf16_true": "the TensorDataset in host memory (32,768 B) and Lightning's host "
    "scalars",
    **dict.fromkeys(
        ("litgpt_finetune_lora", "litgpt_finetune_full", "litgpt_pretrain"),
        "torchmetrics' RunningMean default states on the host (12 B) and LitGPT's and "
        "Lightning's host scalars",
    ),
}
"""Programs whose real CPU run counts host memory a GPU's allocator would not see."""
NOT_TRACED = {
    "torchtitan_debugmodel_2ranks": "the RoPE table (freqs_cis, 256 x 8 complex64, 16,384 B) "
    "that torchtitan's init_weights remakes under `with torch.device(self.freqs_cis.device)`: "
    "a device rebuilt from an emulated tensor's is the CPU to the trace (trace/emulation/cuda_emulation.py, "
    "FakeCuda.device), so the trace makes it in host memory, where a GPU run has it on the GPU; "
    "and on the host, the dataset's last sample (257 int64, 2,056 B); with both, the trace is "
    "1,204 B above the real run, not traced to its source",
}
"""Programs whose prediction misses device memory, what it is and why (a known miss: a
difference, not host memory)."""


NANOGPT_CHECKOUT = "VRAMLEDGER_NANOGPT"
"""A checkout of karpathy/nanoGPT (train.py, model.py, configurator.py); without it the nanogpt
case is left out, and the table says so."""

PLAIN_RUN_RELATIVE = 0.005
"""The bound each program is held to: the prediction plus the host tensors the run names
(``host_bytes``) within 0.5 % of the plain run (tests/plain_run.py holds the tests to it)."""
LIGHTNING_PRECISIONS = ("lightning_bf16_mixed", "lightning_bf16_true")

LITGPT_STEPS = 3
"""`--max-steps` of the LitGPT cases (LitGPT would run 100 steps: stopped before its final save
and merge)."""
LITGPT_COMMON = [
    *("--train.global_batch_size", "2", "--train.micro_batch_size", "2"),
    *("--train.lr_warmup_steps", "1"),
    *("--eval.interval", "1000", "--eval.final_validation", "false"),
    *("--devices", "1", "--out_dir", "out", "--logger_name", "csv"),
]
LITGPT_FINETUNE = [
    *("checkpoint", "--data", "JSON", "--data.json_path", "data.json"),
    *("--data.val_split_fraction", "0.25", "--data.num_workers", "0", "--train.epochs", "100"),
    *("--train.max_steps", "100"),
]
LITGPT = {
    "litgpt_finetune_lora": ["finetune_lora", *LITGPT_FINETUNE],
    "litgpt_finetune_full": ["finetune_full", *LITGPT_FINETUNE, "--precision", "bf16-true"],
    "litgpt_pretrain": [
        *("pretrain", "tiny", "--model_config", "checkpoint/model_config.yaml"),
        *("--data", "litgpt_tiny.TinyTokens", "--tokenizer_dir", "checkpoint"),
        # pretrain takes no max_steps: 100 steps of 2 x 64 tokens
        *("--train.max_seq_length", "64", "--train.max_tokens", "12800"),
    ],
}
"""LitGPT's console script on the tiny checkpoint and local data of tests/programs/litgpt_tiny.py
(tests/test_run_litgpt.py runs the same commands); left out where litgpt is not installed."""


TORCHTUNE = {"torchtune_lora_hf": "hf", "torchtune_lora_meta": "meta"}
"""torchtune's `tune run lora_finetune_single_device` on the tiny checkpoint (in that format:
FullModelHFCheckpointer's safetensors, FullModelMetaCheckpointer's torch.save), tokenizer, data
and config of tests/programs/torchtune_tiny.py (tests/test_run_torchtune.py runs the same);
left out where torchtune is not installed."""
TORCHTUNE_COMMAND = ["tune", "run", "lora_finetune_single_device", "--config", "config.yaml"]
TORCHTUNE_RECIPES = {
    "torchtune_recipe_lora_compile_ac_offload": (
        "lora",
        "compile=True",
        "enable_activation_checkpointing=True",
        "enable_activation_offloading=True",
    ),
    "torchtune_recipe_qlora": ("qlora",),
    "torchtune_recipe_full": ("full",),
}
"""torchtune's recipes with the configs its wheel ships (llama3_2/1B_lora_single_device,
1B_qlora_single_device, 1B_full_single_device: optimizer_in_bwd with PagedAdamW8bit), made tiny
by overrides (tests/programs/torchtune_recipes.py; tests/test_run_torchtune_recipes.py runs the
same)."""


def _torchtune_recipe_command(case: str) -> tuple[str, ...]:
    sys.path.insert(0, str(PROGRAMS))
    from torchtune_recipes import command

    name, *overrides = TORCHTUNE_RECIPES[case]
    return command(name, *overrides)


TORCHTUNE_STEPS = 3
"""`--max-steps` of the torchtune cases (its epoch has 4 steps, then a save)."""


TORCHTITAN = "torchtitan_debugmodel_2ranks"
TORCHTITAN_SMALL = ("--training.steps", "3", "--training.seq_len", "256")
"""A short sequence and a small batch (tests/test_run_torchtitan.py runs the same)."""
TORCHTITAN_RANKS = 2
TORCHTITAN_STEPS = 3


def _torchtitan_command() -> list[str]:
    """torchtitan 0.2's entry point with its llama3 debug model config given as flags
    (``torchtitan_tiny.DEBUG_MODEL_02``: SDPA attention, bf16 FSDP2 parameters, selective
    activation checkpointing) as two FSDP2 ranks (`--nproc-per-node 2`), with a tokenizer and
    local data made by tests/programs/torchtitan_tiny.py."""
    sys.path.insert(0, str(PROGRAMS))
    from torchtitan_tiny import DEBUG_MODEL_02

    return [
        *("-m", "torchtitan.train", *DEBUG_MODEL_02, *TORCHTITAN_SMALL),
        *("--training.local_batch_size", "2"),
    ]


BLOCKED: dict[str, str] = {}
"""Cases that cannot be compared today, and why (printed, not run)."""


def _command(case: str, workdir: Path) -> list[str]:
    if case == TORCHTITAN:
        return _torchtitan_command()
    if case in TORCHTUNE_RECIPES:
        return ["tune", *_torchtune_recipe_command(case)]
    if case == "nanogpt":
        source = Path(os.environ[NANOGPT_CHECKOUT])
        return [str(source / "train.py"), str(PROGRAMS / "nanogpt_tiny.py")]
    if case in LITGPT:
        return ["litgpt", *LITGPT[case], *LITGPT_COMMON]
    if case in TORCHTUNE:
        return TORCHTUNE_COMMAND
    if case in LIGHTNING_PRECISIONS:  # Lightning's precision names: bf16-mixed, bf16-true
        precision = case.removeprefix("lightning_").replace("_", "-")
        return [str(PROGRAMS / "lightning_transformer.py"), precision]
    return [str(PROGRAMS / f"{case}.py")]


def _nanogpt_workdir() -> Path:
    """train.py execs configurator.py from the working folder and reads data/tiny there."""
    import numpy as np

    workdir = Path(tempfile.mkdtemp(prefix="vramledger-nanogpt-"))
    shutil.copy(Path(os.environ[NANOGPT_CHECKOUT]) / "configurator.py", workdir)
    data = workdir / "data" / "tiny"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 65, 20000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 65, 4000, dtype=np.uint16).tofile(data / "val.bin")
    return workdir


def _litgpt_workdir() -> Path:
    """The tiny checkpoint and data (``litgpt_tiny.make``) in a new folder."""
    sys.path.insert(0, str(PROGRAMS))
    from litgpt_tiny import make

    workdir = Path(tempfile.mkdtemp(prefix="vramledger-litgpt-"))
    make(workdir)
    return workdir


def _torchtune_workdir(fmt: str) -> Path:
    """The tiny checkpoint in ``fmt``, tokenizer, data and config (``torchtune_tiny.make``) in a
    new folder."""
    sys.path.insert(0, str(PROGRAMS))
    from torchtune_tiny import make

    workdir = Path(tempfile.mkdtemp(prefix="vramledger-torchtune-"))
    make(workdir, fmt)
    return workdir


def _torchtitan_workdir() -> Path:
    """The tokenizer, config and data (``torchtitan_tiny.make``) in a new folder."""
    sys.path.insert(0, str(PROGRAMS))
    from torchtitan_tiny import make

    workdir = Path(tempfile.mkdtemp(prefix="vramledger-torchtitan-"))
    if missing := make(workdir):
        raise RuntimeError(missing)
    return workdir


def _torchtune_recipes_workdir() -> Path:
    """The tiny checkpoint, tokenizer and data of ``torchtune_recipes.make`` in a new folder."""
    sys.path.insert(0, str(PROGRAMS))
    from torchtune_recipes import make

    workdir = Path(tempfile.mkdtemp(prefix="vramledger-torchtune-recipes-"))
    make(workdir)
    return workdir


def _torchtitan_left_out() -> str | None:
    """Why the torchtitan case cannot run here, else None."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (pip install -e '.[frameworks]')"
    return None


def _rank_peaks(predicted: dict, measured: dict) -> dict[str, list[int]] | None:
    """Each rank's steady peak, predicted and measured (several ranks only)."""
    if predicted.get("world_size", 1) == 1:
        return None
    peaks: dict[str, list[int]] = {}
    for programs, at in ((predicted, 0), (measured, 1)):
        for entry in programs["rank_programs"]:
            for rank in entry["rank_ids"]:
                window = max(entry["optimizer_windows"], key=lambda w: w["peak_bytes"])
                peaks.setdefault(str(rank), [0, 0])[at] = window["peak_bytes"]
    return peaks


def _run(options: list[str], command: list[str], cwd: Path) -> dict:
    if command[:2] == ["-m", "torchtitan.train"]:
        options = [*options, "--nproc-per-node", str(TORCHTITAN_RANKS)]
        options = [*options, "--max-steps", str(TORCHTITAN_STEPS)]
    if command[0] == "litgpt":
        options = [*options, "--max-steps", str(LITGPT_STEPS)]
    if command[0] == "tune":
        options = [*options, "--max-steps", str(TORCHTUNE_STEPS)]
    # litgpt_tiny (the pretraining data module) importable by the program
    path = os.pathsep.join(p for p in (str(PROGRAMS), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-m", "vramledger", "run", "--json", *options, "--", *command],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
        env={**os.environ, "PYTHONPATH": path},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(options)} {command[0]}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", help=f"these programs, comma-separated: {', '.join(CASES)}")
    compare.add_arguments(parser)
    args = parser.parse_args()
    if (status := compare.against_only(args)) is not None:
        return status
    cases = CASES[:4] if args.quick else CASES
    if args.only:
        cases = [c.strip() for c in args.only.split(",") if c.strip()]
        if unknown := sorted(set(cases) - set(CASES)):
            raise SystemExit(f"--only: unknown {unknown}; use {', '.join(CASES)}")
    if not os.environ.get(NANOGPT_CHECKOUT) and "nanogpt" in cases:
        cases = [c for c in cases if c != "nanogpt"]
        print(f"nanogpt left out: set {NANOGPT_CHECKOUT} to a checkout of karpathy/nanoGPT")
    if importlib.util.find_spec("litgpt") is None and set(cases) & set(LITGPT):
        cases = [c for c in cases if c not in LITGPT]
        print("litgpt cases left out: litgpt is not installed (pip install -e '.[frameworks]')")
    tune_cases = {*TORCHTUNE, *TORCHTUNE_RECIPES}
    if importlib.util.find_spec("torchtune") is None and set(cases) & tune_cases:
        cases = [c for c in cases if c not in tune_cases]
        print(
            "torchtune cases left out: torchtune is not installed (pip install -e '.[frameworks]')"
        )
    commit = provenance.commit()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    console = Console(width=140)
    table = Table(title="vramledger run --target cpu vs --measure: each optimizer's steady peak")
    columns = ("program", "optimizer", "predicted", "measured", "difference", "host named")
    for col in (*columns, "CUDA (H100)"):
        table.add_column(col, justify="left" if col in ("program", "optimizer") else "right")
    rows = []
    if TORCHTITAN in cases and (why := _torchtitan_left_out()):
        cases = [c for c in cases if c != TORCHTITAN]
        print(f"{TORCHTITAN} left out: {why}")
    for case in [c for c in cases if c in BLOCKED]:
        print(f"{case} left out: blocked: {BLOCKED[case]}")
    cases = [c for c in cases if c not in BLOCKED]
    for case in cases:
        if case == "nanogpt":
            cwd = _nanogpt_workdir()
        elif case in LITGPT:
            cwd = _litgpt_workdir()
        elif case in TORCHTUNE:
            cwd = _torchtune_workdir(TORCHTUNE[case])
        elif case in TORCHTUNE_RECIPES:
            cwd = _torchtune_recipes_workdir()
        elif case == TORCHTITAN:
            cwd = _torchtitan_workdir()
        else:
            cwd = Path(tempfile.mkdtemp())
        command = _command(case, cwd)
        predicted = _run(["--target", "cpu"], command, cwd)
        measured = _run(["--measure"], command, cwd)
        cuda = _run(["--gpu", "h100-80gb"], command, cwd)
        for p, m, c in zip(
            predicted["optimizer_windows"],
            measured["optimizer_windows"],
            cuda["optimizer_windows"],
            strict=True,
        ):
            diff = m["peak_bytes"] - p["peak_bytes"]
            host = predicted.get("host_bytes", 0)
            rows.append(
                {
                    "program": case,
                    "optimizer": p["optimizer"],
                    "steps": p["steps"],
                    "predicted_bytes": p["peak_bytes"],
                    "measured_bytes": m["peak_bytes"],
                    "difference_bytes": diff,
                    "relative": diff / m["peak_bytes"],
                    "host_memory_named": HOST.get(case),
                    "host_bytes_named_by_run": host,
                    "within_plain_run_bound": abs(diff - host)
                    <= PLAIN_RUN_RELATIVE * m["peak_bytes"],
                    **({"not_traced": NOT_TRACED[case]} if case in NOT_TRACED else {}),
                    "cuda_h100_predicted_bytes": c["peak_bytes"],
                    **(
                        {"rank_peaks": ranks} if (ranks := _rank_peaks(predicted, measured)) else {}
                    ),
                }
            )
            table.add_row(
                case,
                p["optimizer"],
                f"{p['peak_bytes']:,}",
                f"{m['peak_bytes']:,}",
                f"{diff:+,}"
                + (" (host)" if case in HOST and diff else "")
                + (" (not traced)" if case in NOT_TRACED and diff else ""),
                f"{host:,}",
                f"{c['peak_bytes']:,}",
            )
        console.print(f"[dim]{case}: done[/dim]")
    console.print(table)
    unexplained = [r for r in rows if not r["within_plain_run_bound"] and not r.get("not_traced")]
    for name, why in HOST.items():
        console.print(f"[dim]host: {name}: {why}[/dim]")
    for name, why in NOT_TRACED.items():
        console.print(f"[dim]not traced: {name}: {why}[/dim]")
    out = args.out or provenance.result_path("programs", commit)
    out.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "started": started,
                "commit": commit,
                "machine": provenance.machine(),
                "cases": rows,
                "host_memory": HOST,
                "unexplained_differences": len(unexplained),
            },
            indent=2,
        )
    )
    console.print(f"[dim]wrote {out}[/dim]")
    return compare.after_run(args, out) or (1 if unexplained else 0)


if __name__ == "__main__":
    sys.exit(main())
