"""The HTML report as a person sees it: opened in headless Chromium (Debian's ``chromium``),
rendered without console errors, with its chart elements drawn, and screenshotted."""

import os
import re
import shutil

import pytest

from vramledger import estimate
from vramledger.cli import main
from vramledger.inputs.gpus import resolve_gpu
from vramledger.inputs.spec import TrainingSpec
from vramledger.measure import measure
from vramledger.plan.search import plan
from vramledger.render.html import write_html

from .conftest import fixture

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("VRAMLEDGER_REQUIRE_BROWSER") == "1"
"""CI installs Chromium and sets this: there the browser tests must run, not skip."""
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not REQUIRED,
    reason="Debian's chromium is not installed (apt-get install chromium); CI installs it",
)
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def open_in_browser(path, screenshot):
    """(console messages and page errors, the page's chart counts) of ``path`` in Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        messages = []
        page.on("console", lambda m: messages.append((m.type, m.text)))
        page.on("pageerror", lambda e: messages.append(("pageerror", str(e))))
        requests = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(path.as_uri())
        counts = {
            "categories": len(page.query_selector_all("#timeline polygon.category")),
            "peak": len(page.query_selector_all("#peak circle")),
            "front": len(page.query_selector_all("#front circle.candidate")),
            "tables": len(page.query_selector_all("table")),
        }
        box = page.query_selector("#timeline") and page.query_selector("#timeline").bounding_box()
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    return messages, counts, box, requests


def _self_contained(text: str) -> bool:
    """Nothing to fetch: no scripts, stylesheets or images from anywhere."""
    return not re.search(r"<script|<link|<img|src=|url\(", text)


def test_estimate_report_renders_its_timeline_and_peak(tmp_path):
    ledger = estimate(model=fixture("tiny-llama.json"), seq_len=64, gpu="a100-80gb")
    path = write_html(ledger, tmp_path / "estimate.html")
    assert _self_contained(path.read_text())
    messages, counts, box, requests = open_in_browser(path, tmp_path / "estimate.png")
    assert messages == []
    assert requests == [path.as_uri()]  # the page fetched nothing else
    drawn = [c for c, n in ledger.at_peak.items() if n] + [
        c for c, n in ledger.first_step_at_peak.items() if n
    ]
    assert counts["categories"] >= len(set(drawn)) - 1  # every category that holds memory
    assert counts["peak"] == 1 and counts["tables"] >= 2
    assert box["width"] > 600 and box["height"] > 200
    assert (tmp_path / "estimate.png").stat().st_size > 20_000


def test_plan_report_draws_its_front(tmp_path):
    spec = TrainingSpec(model=fixture("small-llama.json"), seq_len=64, precision="bf16-master")
    result = plan(
        spec,
        resolve_gpu(memory="170MiB"),
        optimizers=["adamw"],
        margin=0,
        max_gpus=8,
        checkpointing=(False,),
        offloads=("none",),
        workers=1,
    )
    path = write_html(result, tmp_path / "plan.html")
    messages, counts, _, _ = open_in_browser(path, tmp_path / "plan.png")
    assert messages == [] and counts["front"] == len(result.front) > 0


def test_measure_report_compares_category_by_category(tmp_path):
    m = measure(model=fixture("tiny-llama.json"), seq_len=32, target="cpu", compare=True)
    path = write_html(m, tmp_path / "measure.html")
    text = path.read_text()
    assert "category by category" in text
    for category, _, _ in m.by_category():
        assert f">{category.value}<" in text
    messages, counts, _, _ = open_in_browser(path, tmp_path / "measure.png")
    assert messages == [] and counts["categories"] > 0


def text_boxes(path, screenshot):
    """The bounding box of every label of the timeline chart, as Chromium lays them out."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.goto(path.as_uri())
        boxes = page.eval_on_selector_all(
            "#timeline text",
            "els => els.map(e => { const b = e.getBBox();"
            " return [e.textContent, b.x, b.y, b.width, b.height]; })",
        )
        page.query_selector("#timeline").screenshot(path=str(screenshot))
        browser.close()
    return boxes


def _overlap(a, b):
    (_, ax, ay, aw, ah), (_, bx, by, bw, bh) = a, b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


@pytest.mark.parametrize("model", ["tiny-gpt2.json", "tiny-llama.json"])
def test_timeline_labels_never_print_over_each_other(tmp_path, model):
    """Short phases (a 2-layer GPT-2's optimizer step is a sliver) and the peak's label: each
    label has room of its own, in Chromium's own layout."""
    ledger = estimate(model=fixture(model), seq_len=64, grad_checkpointing=True)
    path = write_html(ledger, tmp_path / "timeline.html")
    boxes = text_boxes(path, tmp_path / "timeline.png")
    labels = [b for b in boxes if b[0].strip()]
    assert any(b[0].startswith("peak") for b in labels)
    assert any(b[0].startswith(("forward", "fwd")) for b in labels)
    clashes = [
        (a[0], b[0]) for i, a in enumerate(labels) for b in labels[i + 1 :] if _overlap(a, b)
    ]
    assert clashes == []


@pytest.mark.parametrize("command", ["advise", "fit"])
def test_cli_writes_reports(tmp_path, capsys, command):
    path = tmp_path / f"{command}.html"
    args = [command, fixture("tiny-llama.json"), "--seq-len", "32", "--gpu-memory", "40MiB"]
    args += ["--margin", "0", "--html", str(path)]
    if command == "fit":
        args += ["--checkpointing", "off"]
    assert main(args) == 0
    capsys.readouterr()
    messages, counts, _, _ = open_in_browser(path, tmp_path / f"{command}.png")
    assert messages == [] and counts["tables"] >= 1
