"""The trace cache (``trace/core/cache.py``) and the command line's answer cache (``answer_cache.py``):
a cached answer is the uncached one, field for field; an entry from another version is never
used; the key changes with everything that changes a trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from tests.conftest import fixture, intra_op_threads
from vramledger.cli import main
from vramledger.inputs import cache
from vramledger.inputs.spec import TrainingSpec
from vramledger.predict.step import _engine, estimate, policy_for
from vramledger.record.timeline import Timeline
from vramledger.trace.core import cache as trace_cache

TINY = fixture("tiny-llama.json")
TIMINGS = {"seconds", "search_seconds", "workers"}
"""Fields that say how long an answer took (or on how many processes), not what it is."""


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    """The cache on, in a folder of this test's own (conftest turns it off for the suite)."""
    monkeypatch.setenv(cache.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.NO_CACHE_VARIABLE, raising=False)
    return tmp_path / "cache"


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def entries(kind: str) -> int:
    return cache.info()["kinds"][kind]["entries"]


def key_of(spec: TrainingSpec, **overrides) -> dict | None:
    args = {"extend_blocks": True, "rank": 0, "routing": "balanced", "blocks_verified": False}
    args.update(overrides)
    return trace_cache.trace_key(spec, policy_for(spec), _engine(spec), **args)


# -- the key --------------------------------------------------------------------------------
def test_every_spec_field_is_in_the_key_or_excluded_with_a_reason():
    names = {f.name for f in fields(TrainingSpec)}
    assert set(trace_cache.NOT_IN_KEY) <= names
    assert all(reason.strip() for reason in trace_cache.NOT_IN_KEY.values())
    key = key_of(TrainingSpec(model=TINY))
    assert set(key["spec"]) == names - set(trace_cache.NOT_IN_KEY)


def test_the_answer_caches_gpu_options_are_the_fields_not_in_the_trace_key():
    """The answer cache keeps its own list (it answers before torch is imported, and the trace
    cache's module imports it): the options of exactly the fields a trace does not read."""
    from vramledger import answer_cache

    flags = tuple(f"--{name.replace('_', '-')}" for name in trace_cache.NOT_IN_KEY)
    assert sorted(answer_cache.GPU_OPTIONS) == sorted(flags)


TRACE_CHANGES = {
    "task": "causal-lm",
    "batch_size": 3,
    "seq_len": 96,
    "precision": "bf16-mixed",
    "attn_implementation": "eager",
    "lora": "r=8,targets=q_proj",
    "quantize": "nf4",
    "optimizer": "sgd",
    "optimizer_kwargs": {"optimizer_kwargs": {"foreach": False}},
    "grad_checkpointing": True,
    "grad_accum": 2,
    "world_size": {"world_size": 2, "strategy": "ddp"},
    "strategy": {"world_size": 4, "strategy": "fsdp"},
    "offload": "optimizer",
    "tp": {"world_size": 4, "tp": 2, "strategy": "fsdp"},
    "freeze": ("model.embed_tokens",),
    "target": "cpu",
}


@pytest.mark.parametrize("name", sorted(TRACE_CHANGES))
def test_the_key_changes_with_each_trace_changing_option(name):
    change = TRACE_CHANGES[name]
    change = change if isinstance(change, dict) else {name: change}
    base = {"world_size": 4, "strategy": "ddp"} if "world_size" in change else {}
    before = TrainingSpec(model=TINY, **base)
    assert key_of(before) != key_of(TrainingSpec(model=TINY, **{**base, **change}))


def test_the_key_changes_with_the_config_contents_and_the_trace_switches(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(Path(TINY).read_text())
    spec = TrainingSpec(model=str(config))
    before = key_of(spec)
    data = json.loads(config.read_text())
    data["intermediate_size"] += 64
    config.write_text(json.dumps(data))
    assert key_of(spec) != before
    assert key_of(spec, rank=1) != key_of(spec)
    assert key_of(spec, routing="first") != key_of(spec)
    assert key_of(spec, extend_blocks=False) != key_of(spec)
    assert key_of(spec, blocks_verified=True) != key_of(spec)


def test_gpus_of_one_compute_capability_share_a_key_and_others_do_not():
    spec = TrainingSpec(model=TINY, gpu="h100-80gb")
    assert key_of(spec) == key_of(replace(spec, gpu="h200", margin="1GiB", gpu_memory="70GiB"))
    assert key_of(spec) != key_of(replace(spec, gpu="a100-80gb"))


def test_a_cpu_targets_key_holds_the_thread_count_and_kernel_choice(monkeypatch):
    """The CPU kernels' scratch is measured in the estimating process, and depends on its
    intra-op thread count and on oneDNN's instruction-set cap (trace/core/cpu_scratch.py): a
    trace made under other settings is not reused. A GPU target's is."""
    import torch

    spec = TrainingSpec(model=TINY, target="cpu")
    gpu = TrainingSpec(model=TINY, gpu="h100-80gb")
    before, before_gpu = key_of(spec), key_of(gpu)
    with intra_op_threads(torch.get_num_threads() + 1):
        assert key_of(spec) != before
        assert key_of(gpu) == before_gpu
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert key_of(spec) != before
    assert key_of(gpu) == before_gpu


def test_code_is_not_cached():
    assert key_of(TrainingSpec(model=fixture("models.py") + ":tiny_mlp")) is None
    assert key_of(TrainingSpec(model=TINY, optimizer="mypackage.optim.Fancy")) is None
    assert key_of(TrainingSpec(model=TINY, optimizer="torch.optim.AdamW")) is not None


# -- what is stored --------------------------------------------------------------------------
def test_a_timeline_is_read_back_field_for_field(cache_on):
    timeline = estimate(TrainingSpec(model=TINY, seq_len=32)).timeline
    assert {f.name for f in fields(Timeline)} <= set(trace_cache._CODECS)
    coded = json.loads(json.dumps(trace_cache.encode_timeline(timeline)))
    assert trace_cache.decode_timeline(coded) == timeline


def test_cached_estimates_equal_uncached_ones_field_for_field(cache_on):
    specs = [
        TrainingSpec(model=TINY, seq_len=32, gpu="h100-80gb"),
        TrainingSpec(model=TINY, seq_len=32, gpu="h200", margin="1GiB"),  # the H100's trace
        TrainingSpec(model=TINY, seq_len=32, world_size=2, strategy="fsdp", offload="optimizer"),
        TrainingSpec(model=TINY, seq_len=32, precision="bf16-mixed", target="cpu"),
    ]
    with cache.disabled():
        uncached = [estimate(s) for s in specs]
    assert entries("traces") == 0
    cold = [estimate(s) for s in specs]
    stored = entries("traces")
    assert stored == 3  # the H200 question reused the H100's trace
    warm = [estimate(s) for s in specs]
    assert entries("traces") == stored
    for a, b, c in zip(uncached, cold, warm, strict=True):
        assert without_timings(a.to_dict()) == without_timings(b.to_dict())
        assert without_timings(a.to_dict()) == without_timings(c.to_dict())
        assert a.timeline == c.timeline


def fit_args():
    return ["fit", TINY, "--gpu-memory", "200MiB", "--margin", "0", "--seq-len", "32"]


def plan_args():
    return [
        "plan",
        TINY,
        "--gpu-memory",
        "100MiB",
        "--margin",
        "0",
        "--max-gpus",
        "8",
        "--optimizers",
        "adamw,sgd-momentum",
        "--seq-len",
        "32",
        "--workers",
        "1",
    ]


@pytest.mark.parametrize("args", [fit_args(), plan_args()], ids=["fit", "plan"])
def test_cached_fit_and_plan_equal_uncached_ones_field_for_field(cache_on, capsys, args):
    answers = []
    for extra in (["--no-cache"], [], []):  # uncached, cold cache, warm cache
        assert main([*args, *extra, "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out))
        if extra:
            os.environ.pop(cache.NO_CACHE_VARIABLE, None)  # --no-cache set it for the workers
            assert entries("traces") == 0
    assert entries("traces") > 0
    assert without_timings(answers[0]) == without_timings(answers[1])
    assert without_timings(answers[0]) == without_timings(answers[2])


# -- versions --------------------------------------------------------------------------------
def test_an_entry_from_another_version_is_never_used(cache_on, monkeypatch):
    spec = TrainingSpec(model=TINY, seq_len=32)
    key = key_of(spec)
    trace_cache.TRACES.put(key, {"result": "from this version"})
    assert trace_cache.TRACES.get(key) == {"result": "from this version"}
    # another version looks in its own folder, and never finds this entry
    monkeypatch.setattr(cache, "fingerprint", lambda: "another-version")
    assert trace_cache.TRACES.get(key) is None
    # an entry in this version's place whose header names another version is deleted unread
    monkeypatch.undo()
    monkeypatch.setenv(cache.CACHE_DIR_VARIABLE, str(cache_on))
    monkeypatch.delenv(cache.NO_CACHE_VARIABLE, raising=False)
    path = trace_cache.TRACES._path(key)
    monkeypatch.setattr(cache, "fingerprint", lambda: "another-version")
    trace_cache.TRACES.put(key, {"result": "from another version"})
    written = trace_cache.TRACES._path(key)
    monkeypatch.undo()
    monkeypatch.setenv(cache.CACHE_DIR_VARIABLE, str(cache_on))
    monkeypatch.delenv(cache.NO_CACHE_VARIABLE, raising=False)
    path.write_bytes(written.read_bytes())
    assert trace_cache.TRACES.get(key) is None
    assert not path.exists()


def test_the_fingerprint_holds_every_versioned_package():
    assert {"torch", "transformers", "peft", "bitsandbytes", "torchao"} <= set(
        cache.VERSIONED_PACKAGES
    )


# -- bound, info, clear, --no-cache ----------------------------------------------------------
def test_least_recently_used_entries_go_first(cache_on):
    store = cache.Store("traces")
    for n in range(4):
        store.put({"n": n}, {"payload": "x" * 1000})
        path = store._path({"n": n})
        os.utime(path, (1000 + n, 1000 + n))
    os.utime(store._path({"n": 0}), (2000, 2000))  # used last
    size = store._path({"n": 0}).stat().st_size
    assert cache.evict(limit=2 * size) == 2
    assert store.get({"n": 0}) is not None and store.get({"n": 3}) is not None
    assert store.get({"n": 1}) is None and store.get({"n": 2}) is None


def test_cache_info_and_clear(cache_on, capsys):
    estimate(TrainingSpec(model=TINY, seq_len=32))
    assert main(["cache", "info", "--json"]) == 0
    about = json.loads(capsys.readouterr().out)
    assert about["path"] == str(cache_on) and about["kinds"]["traces"]["entries"] == 1
    assert about["max_bytes"] == cache.MAX_CACHE_BYTES
    assert main(["cache", "info"]) == 0
    assert "traces: 1 entries" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "1 entries deleted" in capsys.readouterr().out
    assert entries("traces") == 0


def test_no_cache_neither_reads_nor_writes(cache_on, capsys):
    assert main(["estimate", TINY, "--seq-len", "32", "--json", "--no-cache"]) == 0
    assert os.environ.pop(cache.NO_CACHE_VARIABLE) == "1"
    assert entries("traces") == 0


# -- the command line's answer cache ----------------------------------------------------------
def run(args, env, **kw):
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "vramledger", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        **kw,
    )


def test_a_repeated_question_is_answered_before_torch_is_imported(cache_on):
    env = {k: v for k, v in os.environ.items() if k != cache.NO_CACHE_VARIABLE}
    env[cache.CACHE_DIR_VARIABLE] = str(cache_on)
    args = ["estimate", TINY, "--seq-len", "32", "--json"]
    first, second = run(args, env), run(args, env)
    assert first.returncode == 0 and second.returncode == 0
    made, replay = json.loads(first.stdout), json.loads(second.stdout)
    assert "answer_cache" not in made
    assert replay.pop("answer_cache")["original_timings"] == {"seconds": made["seconds"]}
    assert without_timings(replay) == without_timings(made)
    imported = {line.split("|")[-1].strip() for line in second.stderr.splitlines()}
    assert "torch" not in imported and "transformers" not in imported
    assert entries("answers") == 2  # the output, and the ledger for other GPUs (other_gpu.py)
    # another question, --no-cache and a file-writing option all run the command
    again = run([*args, "--no-cache"], env)
    assert "torch" in {line.split("|")[-1].strip() for line in again.stderr.splitlines()}
    assert json.loads(again.stdout)["peak_bytes"] == json.loads(first.stdout)["peak_bytes"]
    assert entries("answers") == 2


def test_the_answer_key_sees_the_files_and_refuses_code(tmp_path):
    from vramledger.answer_cache import answer_key

    config = tmp_path / "config.json"
    config.write_text(Path(TINY).read_text())
    key = answer_key(["estimate", str(config), "--seq-len", "32"])
    assert key is not None
    config.write_text(Path(TINY).read_text().replace("{", '{"x": 1, ', 1))
    assert answer_key(["estimate", str(config), "--seq-len", "32"]) != key
    assert answer_key(["estimate", "meta-llama/Llama-3-8B"]) is None  # a Hub name
    assert answer_key(["estimate", fixture("models.py") + ":tiny_mlp"]) is None
    assert answer_key(["estimate", str(config), "--html", "x.html"]) is None
    assert answer_key(["measure", str(config)]) is None
    question = ["estimate", str(config), "--target", "cpu"]
    for name in ("OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA"):  # a CPU target's kernel scratch
        with pytest.MonkeyPatch.context() as env:
            env.delenv(name, raising=False)
            before = answer_key(question)
            env.setenv(name, "1")
            assert answer_key(question) != before


def test_a_replayed_answer_says_so_and_gives_this_calls_time(cache_on, capsys):
    """The replay's timings are this call's (issue 32: it showed the earlier run's as its own);
    the answer is the earlier one's, every other field and line."""
    from vramledger.answer_cache import main as cached_main

    args = ["estimate", TINY, "--seq-len", "32", "--gpu", "h100-80gb"]
    outputs = []
    for extra in ([], [], ["--json"], ["--json"]):
        assert cached_main([*args, *extra]) == 0
        outputs.append(capsys.readouterr().out)
    made, replay = outputs[0].splitlines(), outputs[1].splitlines()
    took = [line for line in made if line.startswith("took ")]
    assert len(took) == 1
    said = [line for line in replay if line.startswith("answered from the cache in ")]
    assert len(said) == 1 and said[0].endswith(f"({took[0]})")
    assert "the answer was made 20" in said[0] and " UTC " in said[0]
    assert [x for x in replay if x not in said] == [x for x in made if x not in took]
    made_json, replay_json = json.loads(outputs[2]), json.loads(outputs[3])
    about = replay_json.pop("answer_cache")
    assert about["answered_from_cache"] is True
    assert about["made_at"].startswith("20") and about["made_in_seconds"] > 0
    assert about["original_timings"] == {"seconds": made_json["seconds"]}
    # every timing field is this call's: the top level's and each rank's alike
    assert {r["seconds"] for r in replay_json["ranks"]} == {replay_json["seconds"]}
    assert without_timings(replay_json) == without_timings(made_json)


def test_a_replay_rewrites_every_timing_and_says_where_a_wrapped_line_was():
    from vramledger.answer_cache import replayed

    plan = {"seconds": 101.2, "search_seconds": 12.1, "workers": 2, "front": [{"gpus": 8}]}
    stored = {"stdout": json.dumps(plan), "json": True, "made_at": "2026-12-07T00:20:25+00:00"}
    out = json.loads(replayed({**stored, "seconds": 103.0}, 0.0412))
    assert out["answer_cache"] == {
        "answered_from_cache": True,
        "made_at": "2026-12-07T00:20:25+00:00",
        "made_in_seconds": 103.0,
        "original_timings": {"seconds": 101.2, "search_seconds": 12.1},
    }
    assert (out["seconds"], out["search_seconds"]) == (0.041, 0.0)
    assert out["workers"] == 2 and out["front"] == plan["front"]
    line = "4 estimates in 15.2 s"
    table = {"stdout": f"micro-batch 4\n{line}; sequence lengths in steps of 256\n"}
    text = replayed({**table, "timings": [line], "made_at": stored["made_at"]}, 0.05)
    assert text == (
        "micro-batch 4\nanswered from the cache in 0.05 s; the answer was made 2026-12-07 "
        "00:20 UTC (4 estimates in 15.2 s); sequence lengths in steps of 256\n"
    )
    wrapped = {"stdout": "micro-batch 4\n4 estimates\nin 15.2 s\n", "timings": [line]}
    assert replayed(wrapped, 0.05).endswith(
        "(4 estimates in 15.2 s); the timings above are that run's\n"
    )


# -- an estimate for another GPU or margin, from the answer cache ----------------------------
OTHER_GPU_CASES = {
    "h100 to h200": (["--gpu", "h100-80gb"], ["--gpu", "h200"]),
    "another margin and memory": (
        ["--gpu", "h100-80gb"],
        ["--gpu", "h100-80gb", "--margin", "1GiB", "--gpu-memory", "40GiB"],
    ),
    "no GPU to a memory": ([], ["--gpu-memory=24GiB", "--margin", "0"]),
    "fsdp ranks": (
        ["--world-size", "4", "--strategy", "fsdp", "--gpu", "h200"],
        ["--world-size", "4", "--strategy", "fsdp", "--gpu", "h100-94gb"],
    ),
    "zero1 ranks differ": (
        ["--world-size", "3", "--strategy", "zero1-torch"],
        ["--world-size", "3", "--strategy", "zero1-torch", "--gpu", "h100-80gb"],
    ),
    "sm70 bf16: two notes, a warning": (
        ["--precision", "bf16-mixed", "--gpu", "v100-32gb"],
        ["--precision", "bf16-mixed", "--gpu", "v100-16gb", "--margin", "512MiB"],
    ),
    "cpu target, another margin": (["--target", "cpu"], ["--target", "cpu", "--margin", "3GiB"]),
}
"""(first question, second question) beyond ``estimate TINY --seq-len 32``: the second differs
only in its GPU options, on a GPU of the same compute capability."""


@pytest.mark.parametrize("name", sorted(OTHER_GPU_CASES))
def test_an_estimate_for_another_gpu_or_margin_is_estimates_answer(cache_on, capsys, name):
    """The answer made from the kept ledger of an earlier question (other_gpu.py) is the one
    estimate makes, field for field and line for line, timings aside."""
    from vramledger.answer_cache import main as cached_main

    first, second = OTHER_GPU_CASES[name]
    base = ["estimate", TINY, "--seq-len", "32"]
    for extra in (["--json"], []):
        assert cached_main([*base, *first, *extra]) == 0
        made = capsys.readouterr().out
        assert cached_main([*base, *second, *extra, "--no-cache"]) == 0
        fresh = capsys.readouterr().out
        os.environ.pop(cache.NO_CACHE_VARIABLE, None)  # --no-cache set it for the workers
        assert cached_main([*base, *second, *extra]) == 0
        derived = capsys.readouterr().out
        if extra:
            answer, expected = json.loads(derived), json.loads(fresh)
            about = answer.pop("answer_cache")
            assert about["made_for"] == {
                k: json.loads(made)["spec"][k] for k in ("gpu", "gpu_memory", "margin")
            }
            assert about["original_timings"] == {"seconds": json.loads(made)["seconds"]}
            assert without_timings(answer) == without_timings(expected)
            assert {r["seconds"] for r in answer["ranks"]} == {answer["seconds"]}
        else:
            lines, expected = derived.splitlines(), fresh.splitlines()
            said = [x for x in lines if x.startswith("answered from the cache in ")]
            assert len(said) == 1 and " for the same question with" in said[0]
            assert [x for x in lines if x not in said] == [
                x for x in expected if not x.startswith("took ")
            ]


def test_a_question_for_another_gpu_imports_neither_torch_nor_transformers(cache_on, monkeypatch):
    """A question that needs only traces kept already (another GPU of the same compute capability,
    another margin) is answered before torch is imported (issue 32: it spent 8 s importing
    transformers and torch to read its traces)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as the command sets it: the same key below
    env = {k: v for k, v in os.environ.items() if k != cache.NO_CACHE_VARIABLE}
    args = ["estimate", TINY, "--seq-len", "32", "--gpu", "h100-80gb", "--json"]
    assert run(args, env).returncode == 0
    for other in (["--gpu", "h200"], ["--gpu", "h100-80gb", "--margin", "4GiB"]):
        done = run([*args[:4], *other, "--json"], env)
        assert done.returncode == 0, done.stderr
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()}
        assert "vramledger.ledger.other_gpu" in imported
        assert not {"torch", "transformers", "vramledger.predict.step"} & imported
        assert json.loads(done.stdout)["answer_cache"]["answered_from_cache"] is True


def test_gpu_options_the_command_line_would_refuse_are_not_answered_from_the_cache(
    cache_on, capsys
):
    from vramledger.answer_cache import derived, other_gpu_key
    from vramledger.answer_cache import main as cached_main

    base = ["estimate", TINY, "--seq-len", "32"]
    assert cached_main([*base, "--gpu", "h100-80gb", "--json"]) == 0
    capsys.readouterr()
    assert derived([*base, "--gpu", "h200", "--json"], 0.0) is not None
    # between an option and its value, twice, without a value, another compute capability
    assert derived(["estimate", TINY, "--seq-len", "--gpu", "h200", "32", "--json"], 0.0) is None
    assert other_gpu_key([*base, "--gpu", "h200", "--gpu", "h100-80gb"]) is None
    assert other_gpu_key([*base, "--json", "--margin"]) is None
    assert derived([*base, "--gpu", "a100-80gb", "--json"], 0.0) is None
    # a margin that leaves nothing: the command's own error
    assert derived([*base, "--gpu", "h200", "--margin", "200GiB", "--json"], 0.0) is None
    assert cached_main([*base, "--gpu", "h200", "--margin", "200GiB", "--json"]) == 2
    assert "leaves nothing" in capsys.readouterr().err


def test_a_ledger_is_read_back_whole_and_policy_notes_are_the_policys():
    from vramledger.ledger.ledger import Ledger
    from vramledger.ledger.ledger_record import CODECS, ledger_from_record, ledger_record
    from vramledger.ledger.other_gpu import policy_notes

    assert {f.name for f in fields(Ledger)} == set(CODECS)
    spec = TrainingSpec(model=TINY, seq_len=32, world_size=3, strategy="zero1-torch", gpu="h200")
    with cache.disabled():
        ledger = estimate(spec)
    assert len(ledger.ranks) > 1 and ledger.verdict is not None
    back = ledger_from_record(json.loads(json.dumps(ledger_record(ledger))))
    assert back == ledger and back.timeline is None
    assert [(ids, one) for ids, one in back.ranks] == list(ledger.ranks)
    assert back.to_dict() == ledger.to_dict()
    for other in (
        TrainingSpec(model=TINY),
        TrainingSpec(model=TINY, gpu="v100-16gb"),
        TrainingSpec(model=TINY, gpu_memory="24GiB"),
        TrainingSpec(model=TINY, target="cpu"),
    ):
        assert policy_notes(other.target, other.gpu_kind()) == policy_for(other).notes()
