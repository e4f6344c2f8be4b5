"""``vramledger serve`` as a person uses it: the server started as a command, the page driven in
headless Chromium (Debian's ``chromium``), its HTTP API under a burst, and what a request may
read checked without a server."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vramledger.cli import main
from vramledger.cli.serve.question import PASTED, Sources, parse_question
from vramledger.inputs.errors import InputError

from .conftest import FIXTURES, fixture
from .test_report import CHROMIUM, FLAGS, REQUIRED

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SLOW_PY = """
import time

import torch


def slow():
    time.sleep(300)
    return torch.nn.Linear(4, 4)


def linear():
    return torch.nn.Linear(4, 4)


def batch(device, batch_size=1):
    return torch.randn(batch_size, 4, device=device)


def loss(model, batch):
    return model(batch).sum()
"""
"""Models from code for a server started with --allow-code: one that takes five minutes to
build (a question that is still running when the next one arrives), one that answers at once."""
TINY = {"kind": "estimate", "source": "config", "model": "tiny-llama.json"}
STARTUP_SECONDS = 120
"""How long the server and its two warm workers may take to start on a shared 2-core machine
(measured: about 15 s with the machine otherwise idle)."""


# -- what a request may read, without a server ------------------------------------------------
def test_configs_are_read_only_under_the_folder(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "a.json").write_text('{"model_type": "llama"}')
    (root / "sub" / "config.json").write_text('{"model_type": "llama"}')
    (root / "notes.txt").write_text("x")
    (outside / "secret.json").write_text('{"model_type": "llama"}')
    (root / "link.json").symlink_to(outside / "secret.json")
    (root / "linkdir").symlink_to(outside)
    sources = Sources(root, None, tmp_path / "private")
    assert sources.config("a.json") == (str(root.resolve() / "a.json"), "a.json")
    assert sources.config("sub")[0] == str(root.resolve() / "sub")
    assert sorted(sources.listed()) == ["a.json", "sub/", "sub/config.json"]
    refused = {
        "../outside/secret.json": "is not a path under the folder",
        "sub/../../outside/secret.json": "is not a path under the folder",
        str(outside / "secret.json"): "is not a path under the folder",
        "C:\\secret.json": "is not a path under the folder",
        "link.json": "leads outside the folder",
        "linkdir/secret.json": "leads outside the folder",
        "notes.txt": "is not a .json file",
        "missing.json": "not found",
    }
    for rel, words in refused.items():
        with pytest.raises(InputError, match=re.escape(words)):
            sources.config(rel)
    with pytest.raises(InputError, match="reads no config files"):
        Sources(None, None, tmp_path / "private").config("a.json")


def test_pasted_configs_are_parsed_as_json(tmp_path):
    sources = Sources(None, None, tmp_path)
    for text, words in [
        ("{'model_type': 'llama'}", f"{PASTED} is not valid JSON: Expecting property name"),
        ("[1, 2]", f"{PASTED} must be a JSON object, not list"),
        ('{"hidden_size": 8}', f"{PASTED} has no 'model_type'"),
    ]:
        with pytest.raises(InputError, match=re.escape(words)):
            sources.paste(text)
    path, shown = sources.paste('{"model_type": "llama", "hidden_size": 8}')
    assert shown == PASTED and Path(path).parent.parent == tmp_path
    assert json.loads(Path(path).read_text()) == {"hidden_size": 8, "model_type": "llama"}


def test_code_runs_only_with_allow_code(tmp_path):
    (tmp_path / "m.py").write_text("def f(): pass\n")
    without = Sources(FIXTURES, None, tmp_path / "private")
    with pytest.raises(InputError, match="runs no Python files") as refused:
        without.code_model("m.py:f")
    assert "start it with --allow-code DIR" in refused.value.one_line()
    body = {**TINY, "form": {"inputs": "m.py:f"}}
    with pytest.raises(InputError, match="runs no Python files"):
        parse_question(body, without)
    allowed = Sources(None, tmp_path, tmp_path / "private")
    assert allowed.code_model("m.py:f") == (f"{tmp_path.resolve() / 'm.py'}:f", "m.py:f")
    for ref in ["../m.py:f", "m.py:os.system", "m.py", "m.txt:f"]:
        with pytest.raises(InputError):
            allowed.code_model(ref)


def test_the_form_takes_only_names_and_numbers(tmp_path):
    sources = Sources(FIXTURES, None, tmp_path)
    q = parse_question({**TINY, "form": {"seq_len": "64", "grad_checkpointing": True}}, sources)
    assert q.spec == {"seq_len": 64, "grad_checkpointing": True}
    for form, words in [
        ({"batch_size": "two"}, "argument --batch-size: invalid int value: 'two'"),
        ({"optimizer": "os.system"}, "the page takes optimizer names"),
        ({"optimizer": "x.py:Opt"}, "the page takes optimizer names"),
        ({"deepspeed": "ds.json"}, "the page takes no field 'deepspeed'"),
    ]:
        with pytest.raises(InputError, match=re.escape(words)):
            parse_question({**TINY, "form": form}, sources)


def test_the_page_offers_every_spec_option_the_cli_takes(tmp_path):
    """Each spec option of ``estimate`` is an input of the page, with the help ``estimate
    --help`` prints, its default and choices, in its section; or a code option (with
    ``--allow-code``); or named with a reason in NOT_ON_PAGE. An option added to the spec is on
    the page without a line here."""
    from vramledger.cli.options import is_positional, spec_fields
    from vramledger.cli.parser import build_parser
    from vramledger.cli.serve.app import choices
    from vramledger.cli.serve.form import CODE_FIELDS, NOT_ON_PAGE, form_fields
    from vramledger.cli.serve.page import page

    options = {f.name for f in spec_fields() if not is_positional(f)}
    fields = form_fields()
    drawn = {name: f for name, f in fields.items() if not f.code}
    assert options == {*fields, *NOT_ON_PAGE} and not set(fields) & set(NOT_ON_PAGE)
    assert set(CODE_FIELDS) == {"inputs", "loss", "tp_plan"} == set(fields) - set(drawn)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    printed = "".join(sub.choices["estimate"].format_help().split())  # argparse wraps lines
    html = page(choices(Sources(FIXTURES, tmp_path, tmp_path)))
    for name, f in fields.items():
        assert "".join(f.help.split()) in printed, name
        assert f"id='f-{name}' data-field='{name}'" in html, name
    assert drawn["gpu"].offered[:2] == ("a100-40gb", "a100-80gb")  # the catalogue, suggested
    assert drawn["strategy"].kind == "choice" and drawn["strategy"].value == ""
    assert (drawn["seq_len"].kind, drawn["seq_len"].value) == ("number", "512")
    assert drawn["grad_checkpointing"].kind == "switch"
    without_code = page(choices(Sources(FIXTURES, None, tmp_path)))
    assert "data-field='inputs'" not in without_code


FORM_WORDS = {
    "batch_size": "4",
    "grad_checkpointing": True,
    "checkpoint_modules": "LlamaDecoderLayer, LlamaMLP",
    "optimizer_kwargs": '{"momentum": 0.9}',
    "precision": "32-true",
    "world_size": "8",
    "strategy": "fsdp",
    "shard_min_params": "1000",
    "reshard_after_forward": "2",
    "freeze": "*.embed_tokens.*",
    "gpu": "h100-80gb",
    "margin": "1GiB",
}
"""A word for each kind of option: a number, a switch, names separated by commas, JSON, a
precision alias, a choice, true/false/N, a pattern, a GPU name and a size."""


def test_the_form_reads_words_as_the_cli_does(tmp_path):
    """The page's words become the spec the CLI makes of the same options, and a bad word is
    refused in the CLI's words."""
    from vramledger.cli.options import spec_values
    from vramledger.cli.parser import build_parser
    from vramledger.cli.serve.form import spec_words

    def cli(words):
        argv = ["estimate", "m.json"]
        for name, word in words.items():
            flag = "--" + name.replace("_", "-")
            argv += [flag] if word is True else [f"{flag}={word}"]
        values = spec_values(build_parser().parse_args(argv))
        return {name: values[name] for name in words}

    assert spec_words(FORM_WORDS) == cli(FORM_WORDS)
    assert spec_words({"seq_len": " ", "grad_checkpointing": False, "strategy": ""}) == {}
    sources = Sources(FIXTURES, None, tmp_path)
    question = parse_question({**TINY, "form": FORM_WORDS}, sources)
    assert question.spec == cli(FORM_WORDS)
    for form, words in [
        ({"strategy": "zero9"}, "argument --strategy: invalid choice: 'zero9'"),
        ({"reshard_after_forward": "x"}, "'x' is not true, false or an integer"),
        ({"tp": "-1"}, None),  # a number argparse takes; the spec refuses it, as on the CLI
        ({"grad_checkpointing": "yes"}, "grad-checkpointing must be true or false"),
        ({"seed": "1"}, "the page takes no field 'seed'"),
        ({"inputs": "slow.py:batch"}, "this server runs no Python files"),
    ]:
        if words is None:
            assert spec_words(form) == {"tp": -1}
            continue
        with pytest.raises(InputError, match=re.escape(words)):
            parse_question({**TINY, "form": form}, sources)


# -- the server -------------------------------------------------------------------------------
def request(url, body=None, headers=None, method=None):
    """(status, JSON or text) of a request; errors are answers too."""
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def wait(url, job, states=("done", "failed", "cancelled"), timeout=90):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status, state = request(f"{url}api/jobs/{job}")
        assert status == 200, state
        if state["state"] in states:
            return state
        time.sleep(0.1)
    raise AssertionError(f"question {job} still {state['state']} after {timeout} s")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped by the server is a zombie: not running
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][0] != "Z"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``vramledger serve tests/fixtures --allow-code CODE --port 0``, its URL and process;
    stopped at the end with SIGTERM, as Ctrl-C stops it, and checked to take its workers along."""
    code = tmp_path_factory.mktemp("code")
    (code / "slow.py").write_text(SLOW_PY)
    command = [sys.executable, "-m", "vramledger", "serve", str(FIXTURES)]
    command += ["--allow-code", str(code), "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert match, line
        url = match.group(0)
        end = time.monotonic() + STARTUP_SECONDS
        while not all(w["ready"] for w in request(url + "api/workers")[1]["workers"]):
            assert time.monotonic() < end and proc.poll() is None
            time.sleep(0.2)
    except BaseException:
        proc.terminate()  # the server takes its workers along
        proc.wait(timeout=30)
        raise
    yield url, proc
    try:
        pids = [w["pid"] for w in request(url + "api/workers")[1]["workers"]]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code in (0, -signal.SIGTERM)  # uvicorn ends by the signal it caught
    time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []


def cli_error(capsys, *args):
    assert main(["estimate", fixture("tiny-llama.json"), *args]) == 2
    return capsys.readouterr().err.strip()


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None and not REQUIRED,
    reason="Debian's chromium is not installed (apt-get install chromium); CI installs it",
)
def test_the_page_answers_in_a_browser(server, tmp_path, capsys):
    """Pick a config, see the bar; change the optimizer, see it change; a bad LoRA gives the
    CLI's line on the page; fit, plan and advise fill their sections; no console errors, and
    nothing fetched from anywhere but the server."""
    from playwright.sync_api import sync_playwright

    url, _ = server
    lora_error = cli_error(capsys, "--seq-len", "64", "--lora", "r=x,targets=q_proj")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1240, "height": 1000})
        messages, requests = [], []
        page.on("console", lambda m: messages.append((m.type, m.text)))
        page.on("pageerror", lambda e: messages.append(("pageerror", str(e))))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(url)

        def until(predicate):
            page.wait_for_function(predicate, timeout=90_000)

        def text(selector):
            return f"document.querySelector('{selector}').innerText"

        def bar():
            return page.eval_on_selector_all(
                "#bar rect.segment",
                "els => Object.fromEntries(els.map(e => "
                "[e.dataset.category, Number(e.dataset.bytes)]))",
            )

        page.fill("#f-gpu", "a100-80gb")
        page.fill("#f-seq_len", "64")
        page.fill("#config", "tiny-llama.json")
        page.press("#config", "Enter")
        until(f"{text('#summary')}.includes('tiny-llama.json')")
        adamw = bar()
        assert adamw["optimizer_state"] > 0 and "fits on a100-80gb" in page.inner_text("#summary")
        assert page.query_selector("#budget") is not None  # the GPU's budget on the bar
        assert page.query_selector_all("#timeline polygon.category")

        page.fill("#f-optimizer", "sgd")
        page.press("#f-optimizer", "Tab")
        until(f"{text('#summary')}.includes(' sgd ')")
        sgd = bar()
        assert "optimizer_state" not in sgd  # plain SGD keeps no state
        assert sgd["parameters"] == adamw["parameters"]
        page.screenshot(path=str(tmp_path / "serve.png"), full_page=True)
        assert (tmp_path / "serve.png").stat().st_size > 30_000

        page.fill("#f-lora", "r=x,targets=q_proj")
        page.press("#f-lora", "Tab")
        until(f"{text('#error')}.length > 0")
        assert page.inner_text("#error") == lora_error

        page.fill("#f-lora", "")
        page.fill("#f-gpu", "")
        page.fill("#f-gpu_memory", "60MiB")
        page.fill("#f-margin", "0")
        page.press("#f-margin", "Tab")
        until(f"{text('#summary')}.includes('60.00 MiB')")
        assert page.inner_text("#error") == ""
        for kind, section in [("fit", "#fit"), ("plan", "#plan"), ("advise", "#advice")]:
            page.click(f"#ask-{kind}")
            until(f"{text('#status')}.startsWith('{kind}: ')")
            status = page.inner_text("#status")
            assert status.startswith(f"{kind}: answered"), status + page.inner_text("#error")
            assert page.query_selector(f"{section} table") is not None
        browser.close()
    assert messages == []
    assert {r.split("/api/")[0].rstrip("/") + "/" for r in requests} == {url}


@pytest.mark.slow
def test_a_new_question_cancels_the_running_one(server):
    url, _ = server
    code = {"source": "code", "form": {"inputs": "slow.py:batch", "loss": "slow.py:loss"}}
    _, first = request(url + "api/ask", {**code, "kind": "estimate", "model": "slow.py:slow"})
    wait(url, first["job"], states=("running",))
    busy = [w["pid"] for w in request(url + "api/workers")[1]["workers"] if w["job"]]
    start = time.monotonic()
    _, second = request(url + "api/ask", {**code, "kind": "estimate", "model": "slow.py:linear"})
    assert wait(url, first["job"])["state"] == "cancelled"
    done = wait(url, second["job"])
    assert done["state"] == "done", done
    assert "slow.py:linear" in done["answer"]["summary"]
    seconds = time.monotonic() - start
    assert seconds < 30  # a ready worker took it: no wait for the slow build
    time.sleep(0.5)
    assert busy and not alive(busy[0])  # the cancelled question's worker was killed


@pytest.mark.slow
def test_bad_requests_get_the_clis_one_line_errors(server, capsys):
    url, _ = server
    status, answer = request(url + "api/ask", {**TINY, "model": "../pyproject.toml"})
    assert status == 400
    assert answer["error"].startswith("vramledger: error: config '../pyproject.toml' is not a path")
    _, job = request(url + "api/ask", {**TINY, "form": {"seq_len": "0"}})
    assert wait(url, job["job"])["error"] == cli_error(capsys, "--seq-len", "0")
    assert request(url + "api/ask", {**TINY}, headers={"Content-Type": "text/plain"})[0] == 415
    assert request(url + "api/ask", {**TINY}, headers={"Host": "evil.example:80"})[0] == 400
    big = json.dumps({**TINY, "source": "paste", "model": " " * (2 << 20)}).encode()
    assert request(url + "api/ask", big)[0] == 413
    assert request(url + "api/jobs/999999")[0] == 404


@pytest.mark.slow
def test_a_burst_of_50_requests(server):
    """50 requests at once, questions and polls: each is answered or refused with a JSON error
    that says why, the server stays up, and the last question is answered."""
    url, proc = server

    def one(i):
        if i % 2:
            return request(url + "api/ask", {**TINY, "form": {"seq_len": str(32 + i)}})
        return request(url + ("api/jobs/1" if i % 4 else "api/workers"))

    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(one, range(50)))
    for status, body in answers:
        assert status in (200, 202, 404, 429, 503), (status, body)
        if status >= 400:
            assert isinstance(body, dict) and body["error"], body
    asked = [body["job"] for status, body in answers if status == 202]
    assert asked and proc.poll() is None
    states = {wait(url, job)["state"] for job in asked}
    assert states <= {"done", "cancelled"}
    _, last = request(url + "api/ask", {**TINY, "form": {"seq_len": "48"}})
    assert wait(url, last["job"])["state"] == "done"


def test_serve_refuses_a_missing_folder_and_a_busy_port(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"vramledger: error: DIR {tmp_path / 'missing'} is not a folder; give a folder"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tmp_path), "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vramledger: error: cannot listen on 127.0.0.1:{port}: Address already in use; pick "
        "another --port"
    )


def test_limits_refuse_in_json_when_full():
    """The limits in front of the app, called as uvicorn calls them: past the requests in flight
    a 503, past the questions a second a 429, each a JSON error with Retry-After."""
    import asyncio

    from vramledger.cli.serve.app import MAX_ASKS_PER_SECOND, MAX_IN_FLIGHT, Limits

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(limits, path, method="GET"):
        sent = []
        headers = [(b"host", b"127.0.0.1:1"), (b"content-type", b"application/json")]
        scope = {"type": "http", "path": path, "method": method, "headers": headers}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await limits(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return start["status"], dict(start["headers"]), json.loads(body)

    limits = Limits(app, ("127.0.0.1",))
    limits.in_flight = MAX_IN_FLIGHT
    status, headers, body = asyncio.run(call(limits, "/api/jobs/1"))
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert body["error"].startswith(f"vramledger serve is busy: {MAX_IN_FLIGHT} requests")
    limits.in_flight = 0
    answers = [
        asyncio.run(call(limits, "/api/ask", "POST")) for _ in range(MAX_ASKS_PER_SECOND + 1)
    ]
    assert [a[0] for a in answers] == [200] * MAX_ASKS_PER_SECOND + [429]
    assert answers[-1][2]["error"].startswith("too many questions")


@pytest.mark.slow
def test_a_pasted_config_is_answered(server):
    url, _ = server
    text = (FIXTURES / "tiny-llama.json").read_text()
    form = {"seq_len": "32", "gpu": "l4"}
    _, job = request(
        url + "api/ask", {"kind": "estimate", "source": "paste", "model": text, "form": form}
    )
    done = wait(url, job["job"])
    assert done["state"] == "done", done
    assert done["answer"]["summary"].startswith("pasted config.json · batch 1×32")
    status, answer = request(url + "api/ask", {**TINY, "source": "paste", "model": "{"})
    assert status == 400
    assert answer["error"] == (
        "vramledger: error: pasted config.json is not valid JSON: Expecting property name "
        "enclosed in double quotes at line 1 column 2; paste the contents of a Hugging Face "
        "config.json"
    )


@pytest.mark.slow
def test_a_worker_that_dies_fails_its_question_and_is_replaced(server):
    """A worker killed from outside (as the kernel's OOM killer would) fails its question with a
    line that says so; a new worker takes its place."""
    url, _ = server
    code = {"source": "code", "form": {"inputs": "slow.py:batch", "loss": "slow.py:loss"}}
    _, job = request(url + "api/ask", {**code, "kind": "estimate", "model": "slow.py:slow"})
    wait(url, job["job"], states=("running",))
    busy = [w["pid"] for w in request(url + "api/workers")[1]["workers"] if w["job"]]
    os.killpg(busy[0], signal.SIGKILL)
    failed = wait(url, job["job"])
    assert failed["state"] == "failed"
    assert failed["error"] == (
        "vramledger: error: the worker answering this question stopped (exit code -9; out of "
        "memory?); ask again"
    )
    workers = request(url + "api/workers")[1]["workers"]
    assert len(workers) == 2 and busy[0] not in [w["pid"] for w in workers]
