"""Compiled regions (``trace/compile/compiled.py``) against plain compiled CPU runs.

The truth is a plain training loop (``fixtures/compiled.py:plain_compiled_run``) whose compiled
code Inductor builds with the system C++ compiler, counted by the CPU allocator
(``cpu_allocator_count``), with no vramledger code and no dispatch mode while it runs, in a fresh
interpreter (what Dynamo compiled before in the same process changes its count: ``_real``). The
estimate compiles the same regions on fake tensors without compiling any kernel. Each real run
compiles one or two graphs (seconds each, less once Inductor's FX graph cache has them), so
each runs once per module (``_real``).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vramledger import Ledger, TrainingSpec, estimate
from vramledger.predict.step import policy_for
from vramledger.trace.compile.compiled import EAGER
from vramledger.trace.core.blocks import same_timeline
from vramledger.trace.core.fake import trace

from .fixtures import compiled as fx
from .fixtures import compiled_functions as fn

COMPILED_PY = str(Path(__file__).parent / "fixtures" / "compiled.py")
BOUND = 0.005
"""Issue 19's "done when": compiled steps within 0.5 % of real compiled CPU runs."""
MODELLED = "compiled regions modelled as Inductor runs them"
SQUARE = dict(
    model=f"{COMPILED_PY}:square_mlp",
    inputs=f"{COMPILED_PY}:square_inputs",
    loss=f"{COMPILED_PY}:square_loss",
    batch_size=64,
    target="cpu",
)
BLOCK = dict(
    inputs=f"{COMPILED_PY}:square_inputs",
    loss=f"{COMPILED_PY}:square_loss",
    batch_size=512,
    optimizer="sgd",
    target="cpu",
)
LOWBIT = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}
FUNCTIONS = "tests.fixtures.compiled_functions"
"""Referred to by module path: its compiled functions import ``compiled.py``'s block."""
CLASSIFIER = dict(
    model=f"{FUNCTIONS}:classifier",
    inputs=f"{FUNCTIONS}:classifier_inputs",
    batch_size=512,
    optimizer="sgd",
    target="cpu",
)
USER_CASES = {
    # case: (the plain run's model, inputs and loss; the estimate's and its eager twin's
    # arguments; the region the notes name)
    "compiled loss function": (
        (fn.classifier, fn.classifier_inputs, fn.compiled_loss),
        dict(loss=f"{FUNCTIONS}:compiled_loss", **CLASSIFIER),
        dict(loss=f"{FUNCTIONS}:eager_loss", **CLASSIFIER),
        "capped_cross_entropy (torch.compile'd function) (2 graphs)",
    ),
    "@torch.compile function in forward": (
        (fn.GeluBlock, fx.square_inputs, fx.square_loss),
        dict(model=f"{FUNCTIONS}:GeluBlock", **BLOCK),
        dict(model=f"{COMPILED_PY}:Block", **BLOCK),
        "compiled_gelu (torch.compile'd function) (2 graphs)",
    ),
    "compiled bound forward": (
        (fn.compiled_forward_block, fx.square_inputs, fx.square_loss),
        dict(model=f"{FUNCTIONS}:compiled_forward_block", **BLOCK),
        dict(model=f"{COMPILED_PY}:Block", **BLOCK),
        "Block.forward (torch.compile'd function) (2 graphs)",
    ),
    "nn.Module.compile()": (
        (fn.module_compiled_block, fx.square_inputs, fx.square_loss),
        dict(model=f"{FUNCTIONS}:module_compiled_block", **BLOCK),
        dict(model=f"{COMPILED_PY}:Block", **BLOCK),
        "Block (nn.Module.compile'd module) (2 graphs)",
    ),
    # a whole model whose blocks the tracker labels: its hooks must stay out of the graph
    "torch.compile(model) with blocks": (
        (fn.compiled_stack, fx.square_inputs, fx.square_loss),
        dict(model=f"{FUNCTIONS}:compiled_stack", **BLOCK),
        dict(model=f"{FUNCTIONS}:eager_stack", **BLOCK),
        "Stack (torch.compile'd module) (2 graphs)",
    ),
    "model.compile() with blocks": (
        (fn.module_compiled_stack_whole, fx.square_inputs, fx.square_loss),
        dict(model=f"{FUNCTIONS}:module_compiled_stack_whole", **BLOCK),
        dict(model=f"{FUNCTIONS}:eager_stack", **BLOCK),
        "Stack (nn.Module.compile'd module) (2 graphs)",
    ),
}


HUGGING_FACE = "compiled tiny Llama"
"""The case of :func:`test_compiled_hugging_face_model_matches_plain_compiled_run`."""
ROOT = Path(__file__).resolve().parent.parent


def plain_peaks(case: str) -> list[int]:
    """Per-step peaks of the plain compiled run of ``case``, in this process."""
    if case == HUGGING_FACE:
        return fn.plain_run(fn.compiled_tiny_llama, fn.llama_inputs, fn.llama_loss, 2)
    if case in USER_CASES:
        (make_model, make_inputs, loss), *_ = USER_CASES[case]
        return fn.plain_run(make_model, make_inputs, loss, batch_size=512)
    if case in LOWBIT:
        import torchao.optim

        cls = getattr(torchao.optim, LOWBIT[case])
        return fx.plain_compiled_run(fx.square_mlp, cls, batch_size=64)
    return fx.plain_compiled_run(
        fx.compiled_block, lambda p: torch.optim.SGD(p, lr=0.01), batch_size=512
    )


@functools.cache
def _real(case: str) -> tuple[list[int], float]:
    """Per-step peaks of the plain compiled run of ``case``, and its seconds: in a fresh
    interpreter, as a user's program runs. In the suite's own process the count depends on what
    Dynamo compiled before it (the compiled tiny Llama's plain run counted 2,514,208 bytes there
    once, 2,220,380 alone; with ``torch._dynamo.reset()`` before it, the compiled stack's counted
    48,539,600 where a fresh interpreter counts 56,957,104, and the estimate 56,956,936)."""
    start = time.perf_counter()
    code = f"import json; from tests.test_compiled import plain_peaks; print(json.dumps(plain_peaks({case!r})))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    return peaks, time.perf_counter() - start


def _within(estimated: int, real: int) -> bool:
    return abs(estimated - real) <= BOUND * real


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOWBIT))
def test_torchao_compiled_step_matches_plain_compiled_run(name):
    pytest.importorskip("torchao", reason="torchao is not installed")
    (first, steady), _ = _real(name)
    ledger = estimate(optimizer=name, **SQUARE)
    assert any(MODELLED in n and "single_param_adam (1 graph)" in n for n in ledger.notes)
    assert _within(ledger.peak_bytes, steady), (ledger.peak_bytes, steady)
    assert _within(ledger.first_step_peak_bytes, first), (ledger.first_step_peak_bytes, first)


@pytest.mark.slow
def test_compiled_mlp_block_matches_plain_compiled_run():
    """A user's ``torch.compile(module)``: forward and backward graphs as Inductor runs them.
    Its Python tanh GELU makes the eager trace of the same block far off (every pointwise step
    saved for backward), so the bound tells the two apart."""
    (first, steady), _ = _real("block")
    ledger = estimate(model=f"{COMPILED_PY}:compiled_block", **BLOCK)
    assert any(
        MODELLED in n and "Block (torch.compile'd module) (2 graphs)" in n for n in ledger.notes
    ), ledger.notes
    assert _within(ledger.peak_bytes, steady), (ledger.peak_bytes, steady)
    assert _within(ledger.first_step_peak_bytes, first), (ledger.first_step_peak_bytes, first)
    eager = estimate(model=f"{COMPILED_PY}:Block", **BLOCK)
    assert eager.peak_bytes > 1.5 * steady
    # each answer says which it is, from what its trace ran
    assert EAGER in eager.notes and EAGER not in ledger.notes, (eager.notes, ledger.notes)


@pytest.mark.slow
def test_compiled_hugging_face_model_matches_plain_compiled_run():
    """``torch.compile`` of a Hugging Face causal LM that computes its own loss: one forward
    and one backward graph, and the zero tangents autograd makes for the logits and KV cache it
    also returns (estimated 4.3 % above the plain run at dadce74; exact since, cause of the
    change not isolated)."""
    (first, steady), _ = _real(HUGGING_FACE)
    ledger = _compiled_llama(batch_size=2, seq_len=32)
    assert any(MODELLED in n and "(2 graphs)" in n for n in ledger.notes), ledger.notes
    assert _within(ledger.peak_bytes, steady), (ledger.peak_bytes, steady)
    assert _within(ledger.first_step_peak_bytes, first), (ledger.first_step_peak_bytes, first)


def test_region_inductor_does_not_run_is_traced_eagerly_with_both_figures():
    """Another backend than Inductor is not modelled: the answer is the eager trace's and the
    notes say so, with the region's eager and outputs-only figures."""
    ledger = estimate(model=f"{COMPILED_PY}:eager_backend_block", **BLOCK)
    eager = estimate(model=f"{COMPILED_PY}:Block", **BLOCK)
    assert ledger.peak_bytes == eager.peak_bytes
    (note,) = [n for n in ledger.notes if "could not be modelled" in n]
    assert "is not Inductor" in note and "eagerly" in note and "outputs only" in note
    assert not any(MODELLED in n for n in ledger.notes)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(USER_CASES))
def test_user_compiled_region_matches_plain_compiled_run(case):
    """A user's compiled function (a loss the loss factory calls, a ``@torch.compile``
    function a forward calls, ``nn.Module.compile()``'s compiled ``_call_impl``) or whole
    model with repeated blocks: its forward and backward graphs as Inductor runs them. Eagerly
    each keeps several full-size pointwise intermediates for backward, so the bound tells the
    two apart."""
    _, arguments, eager_arguments, region = USER_CASES[case]
    (first, steady), _ = _real(case)
    ledger = estimate(**arguments)
    assert any(MODELLED in n and region in n for n in ledger.notes), ledger.notes
    assert _within(ledger.peak_bytes, steady), (ledger.peak_bytes, steady)
    assert _within(ledger.first_step_peak_bytes, first), (ledger.first_step_peak_bytes, first)
    assert estimate(**eager_arguments).peak_bytes > 1.5 * steady


@pytest.mark.parametrize(
    ("loss", "region", "reason"),
    [
        ("eager_backend_loss", "capped_cross_entropy", "its backend 'eager' is not Inductor"),
        ("graph_break_loss", "breaking_cross_entropy", "Unsupported: Call to `torch._dynamo"),
    ],
)
def test_compiled_function_not_modelled_is_traced_eagerly_with_both_figures(loss, region, reason):
    """A function compiled for another backend than Inductor, or one with a graph break, runs
    eagerly, and the notes say so with its eager figure and its outputs-only one (the scalar
    loss: the tensors saved for its backward are not outputs)."""
    ledger = estimate(loss=f"{FUNCTIONS}:{loss}", **CLASSIFIER)
    eager = estimate(loss=f"{FUNCTIONS}:eager_loss", **CLASSIFIER)
    assert ledger.peak_bytes == eager.peak_bytes
    (note,) = [n for n in ledger.notes if "could not be modelled" in n]
    assert note.startswith(f"compiled region {region} (torch.compile'd function) could not")
    assert reason in note and note.endswith("eagerly, 4 B counting its outputs only"), note
    assert not any(MODELLED in n for n in ledger.notes)


@pytest.mark.parametrize(
    ("model", "region", "target"),
    [
        ("gelu_stack", "compiled_gelu (torch.compile'd function)", "cpu"),
        ("gelu_stack", "compiled_gelu (torch.compile'd function)", "cuda"),
        ("compiled_block_stack", "Block (torch.compile'd module)", "cpu"),
        ("module_compiled_stack", "Block (nn.Module.compile'd module)", "cpu"),
    ],
)
def test_compiled_regions_in_blocks_extend_as_a_full_trace(model, region, target):
    """A compiled function called by every block, or every block compiled: the region's buffers
    carry the block's label (a compiled module's own hooks run, as ``nn.Module.__call__`` runs
    them), so tracing two blocks and extending is exactly the full trace."""
    spec = TrainingSpec(
        model=f"{FUNCTIONS}:{model}",
        inputs=f"{COMPILED_PY}:square_inputs",
        loss=f"{COMPILED_PY}:square_loss",
        batch_size=64,
        target=target,
    )
    extended = trace(spec, policy_for(target))
    full = trace(spec, policy_for(target), extend_blocks=False)
    assert any("extended the timeline" in n for n in extended.notes), extended.notes
    assert any(MODELLED in n and region in n for n in extended.notes), extended.notes
    assert same_timeline(extended.timeline, full.timeline)


def _compiled_llama(batch_size: int, seq_len: int) -> Ledger:
    return estimate(
        model=f"{FUNCTIONS}:compiled_tiny_llama",
        inputs=f"{FUNCTIONS}:llama_inputs",
        loss=f"{FUNCTIONS}:llama_loss",
        batch_size=batch_size,
        seq_len=seq_len,
        optimizer="sgd",
        target="cpu",
    )


def test_an_estimate_compiles_as_a_fresh_process_whatever_was_compiled_before():
    """A program in a fresh interpreter compiles its regions with nothing compiled before; this
    process holds what earlier traces and the caller compiled (Dynamo's code and guards per
    code object, its automatic-dynamic record of the sizes each function was compiled at). Each
    trace that reaches a compiled region starts from a fresh Dynamo (``fresh_dynamo``) and
    puts the caller's size record back. Measured at 9f97c06 without it: after ten other tiny
    Llamas compiled in the process (Dynamo alone, forward only, as here), the 2x32 estimate
    gave 2,362,440 B where alone 2,220,380; a run of the slow tests (7cedbfa) and a CI run
    (163f827) saw 2,509,152."""
    import transformers
    from torch._dynamo import pgo

    code = (
        "from tests.test_compiled import _compiled_llama; print(_compiled_llama(3, 24).peak_bytes)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    fresh = int(done.stdout.split()[-1])
    for width in range(80, 240, 16):  # ten other Llamas, compiled in this process
        config = transformers.AutoConfig.for_model(
            "llama", vocab_size=1000, hidden_size=width, intermediate_size=176,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, 1000, (2, 32))
        torch.compile(model, backend="eager")(input_ids=ids, labels=ids)
    record = pgo.get_code_state()
    before = set(record)
    assert _compiled_llama(3, 24).peak_bytes == fresh
    # the trace's compiles left no sizes in this process's record
    assert pgo.get_code_state() is record and set(record) == before
