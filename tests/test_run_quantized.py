"""`vramledger run` on programs that quantize with bitsandbytes (issue 20: "quantized loads have
their real storage layout"): bitsandbytes quantizes on the emulated GPU with its own code
(bnb_weights.py). Checked against the same program run for real on CPU (`run --measure`:
bitsandbytes quantizes on the CPU since 0.46) and against `estimate --quantize` of the same
model and settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vramledger import Category, estimate
from vramledger.inputs.program import ProgramSpec
from vramledger.measure.program import measure_program
from vramledger.predict.program import run_program

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

PROGRAMS = Path(__file__).parent / "programs"
TINY = Path(__file__).parent / "fixtures" / "hub" / "tiny-llama-bf16"
LORA = "r=8,alpha=16,targets=q_proj,v_proj"
REAL_RUN_BOUND = 0.005
"""The issue's bound on a program's prediction against its real CPU run. Measured on
2026-12-03 (steady steps, --target cpu against --measure): hf_qlora nf4 396 B (0.021 %) and
int8 144 B (0.007 %), bnb_layers 380 B (0.028 %) short of the allocator's count. 396 and 144 B
are the sizes traced allocation by allocation in `measure`'s plain run (README-accuracy.md):
bitsandbytes' and peft's import-time tables (144 B) and the bounds bitsandbytes' CPU 4-bit
quantization caches on first use (252 B), host memory the program makes once per process; in
the program's own run they were not traced one by one."""
DYNAMIC_CODE_BYTES = 256 * 4
"""bitsandbytes' 8-bit code (``create_dynamic_map()``, 256 fp32), made on the GPU by the first
double quantization and cached for the process (``bnb.functional.name2qmap``)."""


ROTARY_COPY_BYTES = 8 * 4
"""The tiny Llama's rotary ``inv_freq`` (head_dim 16: 8 fp32), held twice after from_pretrained."""
ADAPTED_LINEARS = 2 * 2
"""q_proj and v_proj of its 2 layers."""


def _spec(name: str, *args: str) -> ProgramSpec:
    return ProgramSpec(program=str(PROGRAMS / f"{name}.py"), args=args)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """The tiny Llama of ``TINY``'s config, saved in bf16 (its declared dtype)."""
    from transformers import AutoConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(TINY)).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _steady(peaks: dict[int, int]) -> dict[int, int]:
    return {k: v for k, v in peaks.items() if k >= 2}


def _close(predicted: dict[int, int], measured: dict[int, int]) -> None:
    assert predicted.keys() == measured.keys()
    for step, peak in predicted.items():
        assert 0 <= measured[step] - peak <= REAL_RUN_BOUND * measured[step], (step, peak)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_program_matches_the_real_cpu_run(kind, weights, capsys):
    """from_pretrained with a BitsAndBytesConfig onto "cuda", peft's
    prepare_model_for_kbit_training and LoRA: the weights quantized where the program puts them,
    within the issue's bound of the real CPU run (where bitsandbytes quantizes on the CPU)."""
    predicted = run_program(_spec("hf_qlora", str(weights), kind), target="cpu")
    measured = measure_program(_spec("hf_qlora", str(weights), kind))
    capsys.readouterr()
    _close(_steady(predicted.step_peaks), _steady(measured.step_peaks))
    assert any(
        n.startswith("bitsandbytes quantized weights on the emulated GPU 14 times")
        for n in predicted.notes
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_program_on_a_gpu_is_the_qlora_estimate(kind, weights, capsys):
    """The same program on an H100 and `estimate --quantize KIND` of the same model and
    settings (bf16 weights, LoRA r=8 on q_proj and v_proj, a 1 x 64 batch, AdamW), in the same
    layout (packed weights and their quantization state as parameters). The differences, each
    named (they cancel to the byte for LLM.int8 on this 2-layer model, not in general):
    bitsandbytes' 8-bit code table (NF4's double quantization makes it on the GPU once and caches
    it; the estimate quantizes on the meta device); the rotary embedding's second inv_freq
    (from_pretrained re-initialises the buffer, the first stays referenced); and peft's
    ``* scaling`` of each adapter, a Python float autograd keeps as an 8-byte CPU tensor until
    backward: host memory in the program trace, device memory in the estimate's."""
    report = run_program(_spec("hf_qlora", str(weights), kind), gpu="h100-80gb")
    capsys.readouterr()
    ledger = estimate(
        model=str(TINY),
        seq_len=64,
        lora=LORA,
        quantize=kind,
        precision="bf16-true",
        gpu="h100-80gb",
    )
    assert report.ledger is not None
    code = 0 if kind == "int8" else DYNAMIC_CODE_BYTES
    scalars = 8 * ADAPTED_LINEARS
    assert report.ledger.peak_bytes == ledger.peak_bytes + code + ROTARY_COPY_BYTES - scalars
    assert report.ledger.at_peak[Category.PARAMETERS] == ledger.at_peak[Category.PARAMETERS] + code
    assert report.ledger.trainable_parameters == ledger.trainable_parameters


def test_bitsandbytes_layers_moved_with_cuda(capsys):
    """Linear4bit and Linear8bitLt made on the CPU and moved with Module.cuda(): quantized on
    the way, as Module._apply does on a GPU, within the bound of the real CPU run."""
    predicted = run_program(_spec("bnb_layers"), target="cpu")
    measured = measure_program(_spec("bnb_layers"))
    capsys.readouterr()
    _close(_steady(predicted.step_peaks), _steady(measured.step_peaks))
    assert predicted.ledger is not None
    # 4-bit: 256 x 512 packed in 65,536 bytes; 8-bit: 512 x 256 int8 and 256 fp32 row scales
    assert predicted.ledger.at_peak[Category.PARAMETERS] >= 65_536 + 131_072 + 1_024


def test_config_only_folder_is_quantized_as_loaded(weights, capsys):
    """A folder with only config.json, given a quantization_config and a device map: loaded by
    from_pretrained itself from uninitialised weights of the config's shapes
    (checkpoint_shapes.py), quantized on the emulated GPU as the saved weights are."""
    loaded = run_program(_spec("hf_qlora", str(weights), "nf4"), gpu="h100-80gb")
    built = run_program(_spec("hf_qlora", str(TINY), "nf4"), gpu="h100-80gb")
    capsys.readouterr()
    assert built.step_peaks == loaded.step_peaks
    assert any(n.startswith(f"{TINY} has a config and no weights") for n in built.notes)
