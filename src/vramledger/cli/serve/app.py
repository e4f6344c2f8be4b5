"""``vramledger serve``: the page and its small JSON API, on Starlette and uvicorn.

Routes: ``GET /`` the page; ``POST /api/ask`` a question (``question.py``), answered with its
job; ``GET /api/jobs/{id}`` the job's state, progress and answer (the page polls it);
``GET /api/workers`` the worker processes. Bad input is answered 400 with the CLI's one-line
error in ``{"error": ...}``.

Limits, each answered with a JSON ``error`` the page shows: at most ``MAX_IN_FLIGHT`` requests
at once (503, with Retry-After), at most ``MAX_ASKS_PER_SECOND`` questions a second (429), a
request body of at most ``MAX_BODY_BYTES`` (413), and only a Host of the address the server
listens on when that is this machine (400: a web page elsewhere cannot reach it by a DNS name
that resolves to localhost); a question must be sent as ``application/json`` (415), which a page of another
origin cannot send without the browser asking first, and this server never says yes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from vramledger.cli.serve.dispatch import Dispatcher
from vramledger.cli.serve.page import page
from vramledger.cli.serve.question import MAX_CONFIG_BYTES, Sources, parse_question
from vramledger.inputs.errors import InputError

MAX_IN_FLIGHT = 32
"""Requests handled at once; more are refused with 503 (the page makes one at a time)."""
MAX_ASKS_PER_SECOND = 20
"""Questions taken in any one second; more are refused with 429 (each cancels the one before,
so a burst past this answers nothing more)."""
MAX_BODY_BYTES = MAX_CONFIG_BYTES + (64 << 10)
"""A pasted config of the largest size read, and the rest of the form."""
DRAIN_BYTES = 16 * MAX_BODY_BYTES
"""The most of a refused request's body read so that its refusal reaches the client."""
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def choices(sources: Sources) -> dict[str, Any]:
    """Where the form's models come from: the configs listed under the folder, and the folders
    (the spec's options are drawn from the spec itself, ``form.py``)."""
    return {
        "configs": sources.listed(),
        "config_dir": str(sources.configs) if sources.configs else None,
        "code_dir": str(sources.code) if sources.code else None,
    }


def _error(status: int, message: str, **headers: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


async def _drain(receive: Any) -> None:
    """Read what the client sends (up to ``DRAIN_BYTES``) before refusing it: a client still
    sending when the connection closes sees a reset instead of the refusal."""
    drained = 0
    while drained <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class Limits:
    """Pure ASGI middleware: requests in flight, questions per second, body size, Host."""

    def __init__(self, app: Any, hosts: tuple[str, ...] | None):
        self.app = app
        self.hosts = hosts
        self.in_flight = 0
        self.asks: deque[float] = deque()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _drain(receive)
            await refusal(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _refusal(self, scope: dict[str, Any]) -> Any:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        if self.hosts is not None and name.strip("[]") not in self.hosts:
            return _error(
                400,
                f"vramledger serve answers on {', '.join(self.hosts)}, not {host!r}",
            )
        if self.in_flight >= MAX_IN_FLIGHT:
            return _error(
                503,
                f"vramledger serve is busy: {MAX_IN_FLIGHT} requests in flight; try again in a "
                "moment",
                **{"Retry-After": "1"},
            )
        if scope["path"] == "/api/ask" and scope["method"] == "POST":
            size = headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
                return _error(413, f"the question is larger than {MAX_BODY_BYTES} bytes")
            if headers.get("content-type", "").split(";")[0].strip() != "application/json":
                return _error(415, "send the question as application/json")
            now = time.monotonic()
            while self.asks and now - self.asks[0] > 1:
                self.asks.popleft()
            if len(self.asks) >= MAX_ASKS_PER_SECOND:
                return _error(
                    429,
                    f"too many questions: at most {MAX_ASKS_PER_SECOND} a second (each "
                    "cancels the one before); ask again when this answer is back",
                    **{"Retry-After": "1"},
                )
            self.asks.append(now)
        return None


@contextlib.asynccontextmanager
async def _closing(dispatcher: Dispatcher) -> Any:
    """The workers end with the server."""
    try:
        yield
    finally:
        dispatcher.close()


def create_app(
    sources: Sources, dispatcher: Dispatcher, hosts: tuple[str, ...] | None = LOCAL_HOSTS
) -> Any:
    """The ASGI app; ``hosts``: the Host names answered (None: any)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    async def index(request: Request) -> HTMLResponse:
        text = await asyncio.to_thread(lambda: page(choices(sources)))
        return HTMLResponse(text, headers={"Cache-Control": "no-store"})

    async def ask(request: Request) -> JSONResponse:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"the question is larger than {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(body)
            question = await asyncio.to_thread(parse_question, data, sources)
        except json.JSONDecodeError as exc:
            return _error(400, f"vramledger: error: the question is not JSON: {exc.msg}")
        except InputError as exc:
            return _error(400, f"vramledger: error: {exc.one_line()}")
        state = await asyncio.to_thread(dispatcher.ask, question)
        return JSONResponse(state, status_code=202)

    async def job(request: Request) -> JSONResponse:
        try:
            job_id = int(request.path_params["job"])
        except ValueError:
            return _error(404, "no such question")
        state = dispatcher.status(job_id)
        if state is None:
            return _error(404, f"no question {job_id} (the server keeps the last ones only)")
        return JSONResponse(state)

    async def workers(request: Request) -> JSONResponse:
        return JSONResponse(dispatcher.workers_state())

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/ask", ask, methods=["POST"]),
            Route("/api/jobs/{job}", job),
            Route("/api/workers", workers),
        ],
        lifespan=lambda app: _closing(dispatcher),
    )
    return Limits(app, hosts)


def serve(
    configs: Path | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    code: Path | None = None,
    debug: bool = False,
    warm_up: bool = True,
) -> int:
    """Run the server until interrupted; prints its address first (port 0: a free one)."""
    try:
        import uvicorn
    except ImportError as exc:
        raise InputError(
            "vramledger serve needs starlette and uvicorn", hint="pip install 'vramledger[serve]'"
        ) from exc
    for folder, option in ((configs, "DIR"), (code, "--allow-code")):
        if folder is not None and not folder.is_dir():
            raise InputError(f"{option} {folder} is not a folder", hint="give a folder")
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)  # connections wait from the moment the address is printed
    except OSError as exc:
        raise InputError(
            f"cannot listen on {host}:{port}: {exc.strerror}", hint="pick another --port"
        ) from exc
    bound = sock.getsockname()[1]
    # another address was asked for to be reached from elsewhere, by names not known here
    hosts = LOCAL_HOSTS if host in LOCAL_HOSTS else None
    with tempfile.TemporaryDirectory(prefix="vramledger-serve-") as private:
        sources = Sources(configs, code, Path(private))
        dispatcher = Dispatcher(debug=debug, warm_up=warm_up)
        dispatcher.start()
        shown = f"[{host}]" if ":" in host else host
        print(f"vramledger serve: http://{shown}:{bound}/ (Ctrl-C stops it)", flush=True)
        if host not in LOCAL_HOSTS:
            print(
                f"vramledger serve: listening on {host}: anyone who reaches it can ask",
                file=sys.stderr,
            )
        config = uvicorn.Config(
            create_app(sources, dispatcher, hosts),
            log_level="info" if debug else "warning",
            access_log=debug,
            lifespan="on",
        )
        try:
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            dispatcher.close()
    return 0
