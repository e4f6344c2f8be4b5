"""``vramledger serve``: a local web page to ask from (estimate, fit, plan, advise), answered by
worker processes through the library API the CLI uses (``app.py``, ``dispatch.py``,
``worker.py``); what it may read is checked in ``question.py``. Needs the ``serve`` extra
(starlette, uvicorn); nothing in the rest of the package imports it."""
