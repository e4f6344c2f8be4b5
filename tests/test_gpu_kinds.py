"""The GPU kind (``--gpu``) selects CUDA's per-architecture decisions and gives a verdict.

Each expectation is PyTorch 2.13's own rule (sdp_utils.cpp, CublasHandlePool.cpp, as read from
the torch 2.13.0 CUDA wheel), not the estimate's formula: which attention kernel runs, and the
cuBLAS workspace PyTorch allocates per thread.
"""

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vramledger import estimate
from vramledger.cli import build_parser, main
from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import CATALOGUE, resolve_gpu
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.units import MIB
from vramledger.inputs.verdict import DEFAULT_MARGIN
from vramledger.predict.step import policy_for
from vramledger.trace.emulation import sdpa_cuda
from vramledger.trace.emulation.cuda_policy import CUBLAS_WORKSPACE_DEFAULT, CUBLAS_WORKSPACE_HOPPER

from .conftest import fixture

LLAMA = dict(model=fixture("tiny-llama.json"), precision="bf16-master", batch_size=1, seq_len=64)


def _storages(ledger):
    """Every storage of the trace as (what made it, bytes, category), in order."""
    tl = ledger.timeline
    return [
        (tl.labels.get(s) or tl.op[s] or "", tl.nbytes[s], tl.tags[s])
        for s in range(len(tl.nbytes))
    ]


def _ops(ledger):
    return {op for op in ledger.timeline.op if op}


def _workspaces(ledger):
    tl = ledger.timeline
    return sorted(tl.nbytes[s] for s, label in tl.labels.items() if label.startswith("cuBLAS"))


def test_a100_and_h100_differ_exactly_in_cublas_workspace_and_attention_kernel():
    a100 = estimate(gpu="a100-80gb", **LLAMA)
    h100 = estimate(gpu="h100-80gb", **LLAMA)
    # sm80: :4096:2:16:8 = 8 MiB + 128 KiB per thread; sm90: :4096:8 = 32 MiB (two threads)
    assert _workspaces(a100) == [CUBLAS_WORKSPACE_DEFAULT] * 2 == [8 * MIB + 128 * 1024] * 2
    assert _workspaces(h100) == [CUBLAS_WORKSPACE_HOPPER] * 2 == [32 * MIB] * 2
    assert any("cuBLAS workspace 8.12 MiB" in n for n in a100.notes)
    assert any("cuBLAS workspace 32.00 MiB" in n for n in h100.notes)
    # sm90 with cuDNN 9.20 tries cuDNN attention first; sm80 runs flash
    assert "aten._scaled_dot_product_flash_attention.default" in _ops(a100)
    assert "aten._scaled_dot_product_cudnn_attention.default" in _ops(h100)
    assert "aten._scaled_dot_product_cudnn_attention_backward.default" in _ops(h100)
    assert not any("flash" in op for op in _ops(h100))
    assert any("ran as flash attention" in n for n in a100.notes)
    assert any("ran as cuDNN attention" in n for n in h100.notes)
    assert any("cuDNN attention first" in n for n in h100.notes)
    # with cuDNN attention off, H100 runs flash too and nothing but the workspaces differs
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        h100_flash = estimate(gpu="h100-80gb", **LLAMA)
    same_size = {CUBLAS_WORKSPACE_HOPPER: CUBLAS_WORKSPACE_DEFAULT}
    rebased = [
        (w, same_size.get(n, n) if w.startswith("cuBLAS") else n, c)
        for w, n, c in _storages(h100_flash)
    ]
    assert rebased == _storages(a100)
    assert a100.parameters == h100.parameters
    assert a100.optimizer_state_bytes == h100.optimizer_state_bytes


def test_v100_runs_no_flash_or_cudnn_attention():
    v100 = estimate(gpu="v100-32gb", **LLAMA)
    ops = _ops(v100)
    assert not any("flash" in op or "cudnn" in op for op in ops)
    # bf16 below sm80: the memory-efficient kernel refuses it, the math path runs (fp32 scores)
    assert "aten._safe_softmax.default" in ops and not any("efficient" in op for op in ops)
    assert any("ran as the math path" in n for n in v100.notes)
    assert any("no flash or cuDNN attention below sm80" in n for n in v100.notes)
    assert _workspaces(v100) == [CUBLAS_WORKSPACE_DEFAULT] * 2
    assert any("no bf16 tensor cores" in w for w in v100.warnings)
    fp16 = estimate(gpu="v100-32gb", **{**LLAMA, "precision": "fp16-master"})
    assert not any("flash" in op or "cudnn" in op for op in _ops(fp16))
    assert not fp16.warnings


def _qkv(d, heads=8, kv_heads=8, dtype=torch.bfloat16, grad=False, d_v=None):
    def t(h, dim):
        return torch.empty(2, h, 128, dim, dtype=dtype, device="meta", requires_grad=grad)

    return t(heads, d), t(kv_heads, d), t(kv_heads, d_v or d)


def _choice(sm, q, k, v, **kwargs):
    return sdpa_cuda.select_backend(q, k, v, compute_capability=sm, **kwargs)


def test_flash_head_dim_limits_when_training_on_sm86_89_and_sm120():
    """check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training takes
    head dims up to 192, or above 224 without dropout."""
    for sm in ((8, 6), (8, 9), (12, 0)):
        assert _choice(sm, *_qkv(208, grad=True)) == "efficient", sm  # (192, 224]
        assert _choice(sm, *_qkv(208)) == "flash", sm  # no grad: no limit
        assert _choice(sm, *_qkv(192, grad=True)) == "flash", sm
        assert _choice(sm, *_qkv(256, grad=True)) == "flash", sm  # (224, 256], no dropout
        assert _choice(sm, *_qkv(256, grad=True), dropout_p=0.1) == "efficient", sm
    assert _choice((8, 0), *_qkv(208, grad=True)) == "flash"
    assert _choice((9, 0), *_qkv(208, grad=True)) == "cudnn"  # cuDNN takes up to 256 on sm90
    assert _choice((8, 0), *_qkv(256, grad=True), dropout_p=0.1) == "flash"


def test_cudnn_attention_first_on_sm90_and_sm100_with_its_head_dim_limits():
    q, k, v = _qkv(128, grad=True)
    assert _choice((9, 0), q, k, v) == "cudnn"
    assert _choice((10, 0), q, k, v) == "cudnn"
    for sm in ((8, 0), (8, 9), (12, 0)):
        assert _choice(sm, q, k, v) == "flash", sm  # cuDNN after math there: never by default
    assert _choice((9, 0), *_qkv(256)) == "cudnn"  # 256 on sm90 itself (cuDNN >= 9.10)
    assert _choice((10, 0), *_qkv(256)) == "flash"  # 128 elsewhere
    assert _choice((10, 0), *_qkv(192, d_v=128)) == "cudnn"  # DeepSeek's dims on sm10x
    assert _choice((9, 0), q, k, v, dropout_p=0.1) == "flash"  # not a multiple of 1/16
    gqa = _qkv(128, kv_heads=2)
    assert _choice((9, 0), *gqa, enable_gqa=True) == "cudnn"
    assert _choice((9, 0), *gqa) == "math"


def test_memory_efficient_dtypes_and_alignment_below_sm80():
    """minimum_gemm_alignment: fp32 has no tensor cores below sm80 (alignment 1, 4 from sm80);
    fp16 8 from sm70; bf16 only from sm80."""
    odd32 = _qkv(30, dtype=torch.float32)
    assert _choice((7, 0), *odd32) == "efficient"
    assert _choice((8, 0), *odd32) == "math"
    half36 = _qkv(36, dtype=torch.float16)
    assert _choice((7, 5), *half36) == "math"
    assert _choice((7, 0), *_qkv(64, dtype=torch.float16)) == "efficient"
    assert _choice((7, 0), *_qkv(64)) == "math"  # bf16


def test_estimate_gpu_parses_without_abbreviations():
    args = build_parser().parse_args(["estimate", "m.json", "--gpu", "a100-80gb"])
    assert args.gpu == "a100-80gb" and args.gpus_per_node is None
    for argv in (
        ["estimate", "m.json", "--gpus", "8"],  # not --gpus-per-node
        ["estimate", "m.json", "--gpu-mem", "24GiB"],
        ["plan", "m.json", "--gpu-mem", "24GiB"],
        ["estimate", "m.json", "--seq", "64"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
    args = build_parser().parse_args(["plan", "m.json", "--gpu", "l4", "--margin", "1GiB"])
    assert (args.gpu, args.margin) == ("l4", "1GiB")


def test_amd_gpus_are_refused_in_one_line(capsys):
    assert main(["estimate", fixture("tiny-llama.json"), "--gpu", "mi300x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "AMD" in err and "hipBLASLt" in err and "HIP caching allocator" in err
    with pytest.raises(InputError):
        TrainingSpec(model="m.json", gpu="mi250x")


def test_verdict_fields_and_line(capsys):
    kwargs = {**LLAMA, "seq_len": 32}
    fits = estimate(gpu="h100-80gb", **kwargs)
    data = fits.to_dict()
    gpu = CATALOGUE["h100-80gb"]
    assert data["gpu"]["name"] == "h100-80gb" and data["gpu"]["compute_capability"] == [9, 0]
    assert data["gpu"]["memory_bytes"] == gpu.memory_bytes
    assert data["margin_bytes"] == DEFAULT_MARGIN
    assert data["fits"] is True
    assert data["headroom_bytes"] == gpu.memory_bytes - DEFAULT_MARGIN - fits.reserved_peak_bytes
    tight = estimate(gpu_memory="60MiB", margin="0GiB", **kwargs)
    assert tight.verdict.fits is False
    assert tight.verdict.headroom_bytes == 60 * MIB - tight.reserved_peak_bytes < 0
    assert estimate(**kwargs).to_dict()["fits"] is None
    argv = ["estimate", fixture("tiny-llama.json"), "--seq-len", "32", "--precision", "bf16-master"]
    assert main([*argv, "--gpu-memory", "60MiB", "--margin", "0GiB"]) == 0
    assert "does not fit on gpu-60MiB" in capsys.readouterr().out
    assert main([*argv, "--gpu", "a100-80gb", "--margin", "4GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["fits"], out["margin_bytes"], out["spec"]["gpu"]) == (True, 4 << 30, "a100-80gb")


def test_policy_follows_the_spec_gpu():
    """plan and advise re-estimate with specs that carry the GPU: the trace follows it."""
    assert policy_for(TrainingSpec(model="m.json", gpu="v100-16gb")).compute_capability == (7, 0)
    assert policy_for(TrainingSpec(model="m.json", gpu=resolve_gpu("b200"))).compute_capability == (
        10,
        0,
    )
    assert policy_for(TrainingSpec(model="m.json")).compute_capability == (9, 0)
    assert policy_for("cpu").name == "cpu"


def test_catalogue_compute_capabilities():
    expected = {
        "v100-16gb": (7, 0), "v100-32gb": (7, 0), "t4": (7, 5), "a100-40gb": (8, 0),
        "a100-80gb": (8, 0), "a10": (8, 6), "a10g": (8, 6), "a40": (8, 6), "rtx-3090": (8, 6),
        "l4": (8, 9), "l40s": (8, 9), "rtx-4090": (8, 9), "h100-80gb": (9, 0),
        "h100-94gb": (9, 0), "h200": (9, 0), "b200": (10, 0), "rtx-5090": (12, 0),
    }  # fmt: skip
    for name, cc in expected.items():
        assert CATALOGUE[name].compute_capability == cc, name
    amd = {g.name for g in CATALOGUE.values() if g.vendor == "amd"}
    assert amd == {"mi250x", "mi300x"}
    assert all(CATALOGUE[n].compute_capability is None for n in amd)
