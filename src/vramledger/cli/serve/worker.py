"""The process that answers the page's questions: ``python -m vramledger.cli.serve.worker FD``.

It imports everything a question needs (torch, transformers, the predictor, the planners, the
HTML renderer) and traces one tiny model once, then says it is ready and answers questions one
at a time. Questions arrive as JSON lines on stdin (``Question.to_dict()`` and a job id);
progress, answers and errors go back as JSON lines on the file descriptor FD (stdout is left to
the libraries, whose chatter must not mix with the answers). The server kills the whole process
group to cancel a question (``dispatch.py``), so nothing here needs to stop half-way.

Questions run through the library API the CLI uses (``estimate``, ``fit``, ``plan``,
``advise``), with the TrainingSpec built from the same fields, so an error is the CLI's line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

from vramledger.cli.options import PARALLEL_OPTIONS, STEP_FIXED_OPTIONS

WARM_UP_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
"""A one-layer Llama traced once at start, so the first question does not pay for the
first-call work of torch's dispatcher and transformers' lazy imports (a few seconds)."""


LEFT_OUT: dict[str, tuple[str, ...]] = {
    "fit": STEP_FIXED_OPTIONS,
    "plan": (*STEP_FIXED_OPTIONS, *PARALLEL_OPTIONS),
}
"""Form fields each question leaves out, as the CLI's command takes no such option
(cli/parser.py): plan answers the layout rather than taking it, fit and plan answer for CUDA at
the default steps. (The page's plan searches the form's one optimizer and precision.)"""


def error_line(exc: BaseException, shown: dict[str, str] | None = None) -> str:
    """The line ``vramledger`` prints for this exception (cli.main), with the server's private
    paths replaced by the names the page shows."""
    from vramledger.inputs.errors import VramledgerError

    if isinstance(exc, VramledgerError):
        line = exc.one_line()
    else:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        line = f"{type(exc).__name__}: {first} (pass --debug for the traceback)"
    for private, name in (shown or {}).items():
        line = line.replace(private, name)
    return f"vramledger: error: {line}"


def answer(question: dict[str, Any], progress: Any) -> dict[str, str]:
    """HTML fragments answering ``question``, keyed by the part of the page they fill."""
    from vramledger.inputs.gpus import resolve_gpu
    from vramledger.inputs.spec import TrainingSpec
    from vramledger.plan.advise import DEFAULT_GPUS_PER_NODE, advise
    from vramledger.plan.fit import fit
    from vramledger.plan.search import plan
    from vramledger.predict.step import estimate
    from vramledger.render import charts, html

    kind, options = question["kind"], question["options"]
    fields = question["spec"]
    fields = {k: v for k, v in fields.items() if k not in LEFT_OUT.get(kind, ())}
    spec = TrainingSpec(model=question["model"], **fields)
    if kind == "estimate":
        ledger = estimate(spec)
        return {
            "summary": summary(ledger, question["shown"]),
            "bar": charts.category_bar_svg(ledger),
            "ledger": "".join(html.ledger_body(ledger)),
        }
    gpu = spec.gpu_kind()
    if gpu is None:
        if kind == "fit":  # the CLI's lines: cmd_fit's, resolve_gpu's for plan and advise
            from vramledger.inputs.errors import InputError

            raise InputError("fit needs a GPU", hint="pass --gpu NAME or --gpu-memory SIZE")
        gpu = resolve_gpu(None, None)
    if kind == "fit":
        result = fit(
            spec,
            gpu,
            maximize=options.get("maximize", "batch-size"),
            margin=spec.margin_bytes,
            workers=1,
        )
        return {"fit": "".join(html.fit_body(result))}
    if kind == "plan":
        result = plan(
            spec,
            gpu,
            optimizers=[spec.optimizer],
            precisions=[spec.precision],
            max_gpus=options.get("max_gpus", 1024),
            margin=spec.margin_bytes,
            workers=1,
            progress=progress,
        )
        return {"plan": "".join(html.plan_body(result))}
    result = advise(spec, gpu, margin=spec.margin_bytes, gpus_per_node=DEFAULT_GPUS_PER_NODE)
    return {"advice": "".join(html.advice_body(result))}


def private_names(question: dict[str, Any]) -> dict[str, str]:
    """The server's resolved paths (which errors name) -> the names the page shows, longest
    first: a config file or folder (and the config.json in it), or FILE.py of FILE.py:FUNCTION."""
    model, shown = question["model"], question["shown"]
    names = {model: shown}
    if shown.endswith(".py") or ".py:" in shown:
        names[model.rpartition(":")[0]] = shown.rpartition(":")[0]
    else:
        folder = model if not model.endswith(".json") else os.path.dirname(model)
        names[os.path.join(folder, "config.json")] = shown
    return dict(sorted(names.items(), key=lambda item: -len(item[0])))


def summary(ledger: Any, shown: str) -> str:
    from html import escape

    from vramledger.inputs.units import format_bytes

    def _e(value: Any) -> str:
        return escape(str(value))

    spec = ledger.spec
    verdict = ""
    if ledger.verdict is not None:
        v = ledger.verdict
        word = "fits" if v.fits else "does not fit"
        verdict = (
            f" · <b class='{'good' if v.fits else 'bad'}'>{word} on {_e(v.gpu.name)}, headroom "
            f"{_e(format_bytes(v.headroom_bytes))}</b>"
        )
    return (
        f"{_e(shown)} · batch {_e(spec.get('batch_size'))}×{_e(spec.get('seq_len'))} · "
        f"{_e(spec.get('precision'))} · {_e(spec.get('optimizer'))} · peak "
        f"<b>{_e(format_bytes(ledger.peak_bytes))}</b>, reserved "
        f"{_e(format_bytes(ledger.reserved_peak_bytes))}{verdict} · {ledger.seconds:.1f} s"
    )


def _send(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def warm_up() -> None:
    from vramledger.inputs.sources import hf_config_from_dict
    from vramledger.predict.step import estimate

    estimate(model=hf_config_from_dict(dict(WARM_UP_CONFIG)), seq_len=16)


def main(argv: list[str]) -> int:
    out = os.fdopen(int(argv[0]), "w", encoding="utf-8")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    from vramledger.inputs.chatter import library_chatter_quieted, quiet_import_chatter

    quiet_import_chatter()
    start = time.perf_counter()
    with library_chatter_quieted():
        import transformers  # noqa: F401

        from vramledger.plan import advise, fit, search  # noqa: F401
        from vramledger.predict import step  # noqa: F401
        from vramledger.render import html  # noqa: F401

        if "--no-warm-up" not in argv:
            try:
                warm_up()
            except Exception:  # a missing optional library: the questions will say so
                pass
    _send(out, {"ready": round(time.perf_counter() - start, 2), "pid": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        job, question = request["job"], request["question"]

        def progress(name: str, done: int, total: int, job: int = job) -> None:
            _send(out, {"job": job, "progress": [name, done, total]})

        try:
            with library_chatter_quieted():
                result = answer(question, progress)
        except Exception as exc:
            _send(out, {"job": job, "error": error_line(exc, private_names(question))})
        else:
            _send(out, {"job": job, "answer": result})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
