"""Errors a user can act on. The CLI prints them as one line (no traceback unless --debug)."""

from __future__ import annotations


class VramledgerError(Exception):
    """Base class: ``message`` says what went wrong, ``hint`` what to do about it."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class InputError(VramledgerError):
    """Bad input: a missing file, malformed config or JSON, an unknown name, impossible sizes."""


class TraceError(VramledgerError):
    """The model's code could not run under the tracer (an operator with no fake-tensor support,
    data-dependent control flow, an exception raised by the user's own code)."""
