"""Error bodies and the API key: OpenAI's `{"error": {...}}` for every failure, and bearer auth."""

from __future__ import annotations

import logging
import secrets
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisched.serve import protocol as p

log = logging.getLogger("minisched.serve")


_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _field_path(loc) -> list[str]:
    """The request field of a pydantic error location: the "body" root dropped, cut before the first
    union-member tag ("str", "list[int]", "TextPart") that pydantic inserts for union fields."""
    out: list[str] = []
    for x in loc:
        if x == "body" and not out:
            continue
        if isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or x[:1].isupper() or x.startswith("function")):
            break
        out.append(str(x))
    return out


def _validation_message(err: dict) -> tuple[str, Optional[str]]:
    loc = _field_path(err.get("loc", ()))
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        why = err.get("ctx", {}).get("error", "invalid JSON")
        return f"We could not parse the JSON body of your request ({why}).", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if not loc and kind in ("model_attributes_type", "dict_type"):
        return "The request body must be a JSON object (send Content-Type: application/json).", None
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    return f"{param}: {err.get('msg', 'invalid value')}" if param else err.get("msg", "invalid request"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(p.APIError)
    async def api_error(request: Request, exc: p.APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        message, param = _validation_message(errors[0]) if errors else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return JSONResponse(p.APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            p.APIError(exc.status_code, str(exc.detail), type=kind).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        err = p.APIError(500, f"internal server error ({type(exc).__name__})", type="server_error")
        return JSONResponse(err.body(), status_code=500)


PROTECTED = ("/v1", "/generate", "/flush_cache", "/debug")  # what needs the API key (path prefixes)


class BearerAuth:
    """Pure ASGI middleware: every /v1 route, /generate, /flush_cache and /debug need `Authorization:
    Bearer <api_key>` (checked before the body is read, so a keyless client learns nothing else)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.key):
                err = p.APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
                )
                resp = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)
