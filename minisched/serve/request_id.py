"""Request ids end to end: the client's (or the router's) id on every log line of its request.

    app.add_middleware(RequestIdMiddleware)   # create_app does this
    current()                                 # the id of the request this task serves, or None

An incoming `X-Request-Id` header is the request's id: sglang-router forwards the one its client
sent (it makes one up only for its own reply, `gnt-...`, and does not send that to the worker),
and so do most proxies. Without one, a route may name one from the body (SGLang's `rid` on
/generate: `adopt`); without either, the id is the call's own (`cmpl-...`), which the routes
already send back. Whatever the id, the response echoes it in `X-Request-Id`.

The id lives in a context variable, set per request by the middleware (each request runs in its
own task, so it never leaks into another); `RequestIdFilter` copies it onto every log record as
`record.request_id` ("-" outside a request). Records made for a request outside its task (its
finish, delivered from the engine thread) pass it explicitly: `extra={"request_id": ...}`.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Optional

HEADER = b"x-request-id"
MAX_LEN = 128  # longer or non-printable ids are ignored (a log line must stay one line)
_current: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("minisched_request_id", default=None)
# per request: the id to echo (a mutable cell, so a route can adopt one after the middleware ran)
_echo: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("minisched_request_id_echo", default=None)


def valid(rid) -> bool:
    return isinstance(rid, str) and 0 < len(rid) <= MAX_LEN and rid.isprintable()


def current() -> Optional[str]:
    return _current.get()


def adopt(rid: Optional[str]) -> Optional[str]:
    """A route names the request's id from its body (SGLang's `rid`) when no header gave one;
    returns the id in force."""
    if _current.get() is None and valid(rid):
        _current.set(rid)
        cell = _echo.get()
        if cell is not None:
            cell[0] = rid
    return _current.get()


class RequestIdMiddleware:
    """Pure ASGI: reads X-Request-Id, sets the context variable, echoes the id in the response
    (overriding the route's own call id only when the client gave one)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = dict(scope["headers"]).get(HEADER)
        given = raw.decode("latin-1") if raw is not None else None
        given = given if valid(given) else None
        _current.set(given)
        cell = [given]
        _echo.set(cell)

        async def send_with_id(message):
            if message["type"] == "http.response.start" and cell[0] is not None:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                headers.append((HEADER, cell[0].encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class RequestIdFilter(logging.Filter):
    """Puts `request_id` on every record (the current request's, "-" outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _current.get() or "-"
        return True


LOG_FORMAT = "%(levelname)s:     %(name)s: [%(request_id)s] %(message)s"


def install_logging(level: str) -> None:
    """`minisched serve`'s logging: the request id on every line (cli/serve.py calls this)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
