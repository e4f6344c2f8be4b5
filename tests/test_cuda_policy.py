"""CUDA's decisions applied to CPU traces: checked against the installed PyTorch's own CUDA
registrations and, where a CPU-only build can run it, against CUDA's real code."""

import subprocess
import sys
import textwrap

import torch

from vramledger import Category, estimate
from vramledger.inputs.categories import Phase
from vramledger.trace.emulation import autocast_cuda, sdpa_cuda
from vramledger.trace.emulation.cuda_policy import CUBLAS_WORKSPACE_HOPPER

from .conftest import FIXTURES, fixture


def test_autocast_lists_are_exactly_the_registered_cuda_autocast_kernels():
    assert autocast_cuda.cuda_autocast_op_names() == set(
        autocast_cuda.registered_cuda_autocast_op_names()
    )


ORACLE = textwrap.dedent(
    """
    import torch
    from torch import nn
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from vramledger.trace.emulation.autocast_cuda import CudaAutocast
    from vramledger.trace.core.fake import fakeify

    class Zoo(nn.Module):
        def __init__(s):
            super().__init__()
            s.fc = nn.Linear(16, 16); s.ln = nn.LayerNorm(16); s.rms = nn.RMSNorm(16)
            s.conv = nn.Conv2d(4, 4, 3); s.gn = nn.GroupNorm(2, 4); s.w = nn.Parameter(torch.empty(16, 16))
        def forward(s, x, img, y):
            h = F.gelu(s.rms(s.ln(s.fc(x)))); h = torch.softmax(h, -1) @ s.w
            h = torch.log_softmax(h, -1) + h.exp() + h.pow(2) + torch.cumsum(h, -1)
            h = torch.cat([torch.einsum("bi,ij->bj", h, s.w), x], -1).sum(-1)
            n = torch.norm(x, dim=-1); a = torch.addcmul(x, x, x); c = s.gn(s.conv(img))
            b = torch.bmm(x.unsqueeze(0), s.w.unsqueeze(0))
            return (F.cross_entropy(s.fc(x), y) + F.mse_loss(h, n) + a.sum() + c.sum() + b.sum()
                    + F.binary_cross_entropy_with_logits(h, n))

    class Rec(TorchDispatchMode):
        def __init__(s): super().__init__(); s.log = []
        def __torch_dispatch__(s, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not str(func).startswith("prim."):
                outs = out if isinstance(out, (tuple, list)) else (out,)
                s.log.append((str(func), tuple(str(o.dtype) for o in outs if isinstance(o, torch.Tensor))))
            return out

    def run(device):
        with torch.device("meta"):
            m = Zoo()
        mode = FakeTensorMode()
        fakeify(m, mode, torch.device(device))
        for p in m.parameters():
            p.requires_grad_(False)  # autograd on fake CUDA tensors needs a CUDA build
        rec = Rec()
        with mode, torch.no_grad():
            x = torch.randn(8, 16, device=device); img = torch.randn(2, 4, 8, 8, device=device)
            y = torch.zeros(8, dtype=torch.long, device=device)
            if device == "cuda":  # real CUDA autocast (torch.autocast refuses without a GPU)
                torch.set_autocast_enabled("cuda", True); torch.set_autocast_dtype("cuda", torch.bfloat16)
                torch.autocast_increment_nesting()
                with rec:
                    m(x, img, y)
            else:
                with CudaAutocast(), torch.autocast("cpu", dtype=torch.bfloat16), rec:
                    m(x, img, y)
        return rec.log

    real, emulated = run("cuda"), run("cpu")
    assert len(real) > 50, real
    assert real == emulated, [(a, b) for a, b in zip(real, emulated) if a != b][:5]
    print("SAME", len(real))
    """
)


def test_emulated_autocast_equals_real_cuda_autocast_on_fake_cuda_tensors():
    """The forward pass under real CUDA autocast (its C++ kernels, on fake CUDA tensors, which a
    CPU-only build can run without autograd) and under the emulation: same ops, same dtypes."""
    result = subprocess.run(
        [sys.executable, "-c", ORACLE], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "SAME" in result.stdout, result.stderr[-3000:]


def test_autocast_overrides_are_removed_after_a_trace():
    estimate(model=fixture("tiny-llama.json"), precision="bf16-mixed", batch_size=1, seq_len=16)
    x = torch.randn(2, 8)
    ln = torch.nn.LayerNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu_dtype = ln(x.bfloat16()).dtype
    assert cpu_dtype == torch.bfloat16  # CPU autocast's own policy (CUDA's would give float32)


def _ops(ledger):
    return {op for op in ledger.timeline.op if op}


def test_attention_kernel_follows_the_target():
    kwargs = dict(
        model=fixture("tiny-llama.json"), precision="bf16-master", batch_size=1, seq_len=32
    )
    cuda = _ops(estimate(target="cuda", gpu="a100-80gb", **kwargs))
    default = _ops(estimate(target="cuda", **kwargs))  # compute capability 9.0: cuDNN first
    cpu = _ops(estimate(target="cpu", **kwargs))
    assert "aten._scaled_dot_product_flash_attention.default" in cuda
    assert "aten._scaled_dot_product_flash_attention_backward.default" in cuda
    assert "aten._scaled_dot_product_cudnn_attention_backward.default" in default
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in cpu


def test_attention_dropout_keeps_flash_on_cuda_but_not_on_cpu():
    """GPT-2 trains with attention dropout: CPU falls back to the math path (an S×S matrix),
    CUDA's flash kernel supports dropout (cuDNN, first on sm90, does not take 0.1: its dropout
    resolution is 1/16)."""
    kwargs = dict(
        model=fixture("tiny-gpt2.json"), precision="bf16-master", batch_size=1, seq_len=64
    )
    cuda, cpu = estimate(target="cuda", **kwargs), estimate(target="cpu", **kwargs)
    assert "aten._scaled_dot_product_flash_attention.default" in _ops(cuda)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in _ops(cpu)
    assert "aten._safe_softmax.default" in _ops(cpu)


def test_backend_selection_rules():
    """On an A100 (sm80: no cuDNN attention by default); per-architecture rules are in
    test_gpu_kinds.py."""

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    def select_backend(*args, **kwargs):
        return sdpa_cuda.select_backend(*args, **kwargs, compute_capability=(8, 0))

    q, kv = t(2, 8, 128, 64), t(2, 2, 128, 64)
    assert select_backend(q, q, q, is_causal=True) == "flash"
    assert select_backend(q, kv, kv, enable_gqa=True) == "flash"
    assert select_backend(q, kv, kv, enable_gqa=False) == "math"
    mask = torch.empty(128, 128, dtype=torch.bool, device="meta")
    assert select_backend(q, q, q, attn_mask=mask) == "efficient"
    q32 = t(2, 8, 128, 64, dtype=torch.float32)
    assert select_backend(q32, q32, q32) == "efficient"
    assert select_backend(t(2, 8, 128, 512), t(2, 8, 128, 512), t(2, 8, 128, 512)) == "efficient"
    q_odd = t(2, 8, 128, 36, dtype=torch.float32)
    assert select_backend(q_odd, q_odd, q_odd) == "efficient"
    q_bad = t(2, 8, 128, 30, dtype=torch.float32)
    assert select_backend(q_bad, q_bad, q_bad) == "math"


def test_cuda_target_holds_two_cublas_workspaces_and_host_step_counters():
    ledger = estimate(target="cuda", model=fixture("tiny-llama.json"), batch_size=1, seq_len=16)
    tl = ledger.timeline
    workspaces = [(tl.labels[s], tl.nbytes[s]) for s in tl.labels if "cuBLAS" in tl.labels[s]]
    assert sorted(workspaces) == [
        ("cuBLAS workspace (autograd thread)", CUBLAS_WORKSPACE_HOPPER),
        ("cuBLAS workspace (main thread)", CUBLAS_WORKSPACE_HOPPER),
    ]
    assert ledger.at_peak[Category.WORKSPACE] >= 2 * CUBLAS_WORKSPACE_HOPPER
    assert ledger.host_bytes > 0  # Adam's step counters
    assert any("foreach" in n for n in ledger.notes)
    assert any("no --gpu given" in n and "9.0" in n for n in ledger.notes)
    assert ledger.allocated_peak_bytes > ledger.peak_bytes  # 512-byte blocks
    assert ledger.peak_phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def test_dropout_keeps_a_bool_mask_on_cuda_and_an_input_dtype_mask_on_cpu():
    """``at::native::dropout`` takes the fused ``native_dropout`` (bool mask) on CUDA tensors and
    decomposes into a mask of the input's dtype on CPU tensors (Dropout.cpp)."""
    model = str(FIXTURES.parent.parent / "benchmarks" / "gpt_layer.py")
    spec = dict(
        model=f"{model}:gpt",
        inputs=f"{model}:inputs",
        loss=f"{model}:loss",
        precision="bf16-true",
    )
    for target, mask_bytes in (("cuda", 1), ("cpu", 2)):
        tl = estimate(target=target, **spec).timeline
        step = tl.steps
        masks = [
            tl.nbytes[s]
            for s in range(tl.num_storages)
            if tl.origin[s] == (step, Phase.FORWARD)
            and tl.module[s] == "layers.1.drop"
            and tl.category(s).value == "activations"
        ]
        # batch 1 x 512 tokens x 512 hidden: one mask per dropout
        assert masks == [512 * 512 * mask_bytes], (target, masks)
