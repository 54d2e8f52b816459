"""How a request body is read: bounded in bytes, and its strings made encodable.

- `BodyLimit` (pure ASGI middleware): a declared `Content-Length` above the limit is a 413 before
  anything is read; a body without one (chunked) is counted as it arrives and answered 413 at the
  first byte past the limit, so the server never holds more than the limit of one body. The body
  read is handed on to the app unchanged; later `receive` calls (the disconnect a handler watches
  for) go straight through.
- `SafeJSONRoute`: a lone UTF-16 surrogate (`"\\ud800"`, legal JSON) cannot be encoded as UTF-8,
  so the tokenizer (and any response echoing the text) would fail on it. Each one is replaced by
  U+FFFD, as OpenAI's tokenizer (tiktoken) does; a valid surrogate pair is one code point after
  json.loads and is kept. (vLLM passes the string to the HF tokenizer, which raises TypeError.)
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import Request

from minisched.serve import protocol as p

_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a surrogate escape in the raw body (cheap pre-check)


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send, int(declared))
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away before the body was whole
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, None)
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, declared):
        got = f"{declared} bytes" if declared is not None else f"more than {self.max_bytes} bytes"
        err = p.APIError(
            413,
            f"the request body has {got}; at most {self.max_bytes} (the server's --max-request-body-bytes)",
            code="request_too_large",
        )
        # Connection: close -- the rest of the body is never read, so the connection cannot be reused
        resp = JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})
        await resp(scope, receive, send)


def replace_surrogates(obj: Any) -> Any:
    if isinstance(obj, str):
        return _SURROGATE.sub("\ufffd", obj)
    if isinstance(obj, list):
        return [replace_surrogates(x) for x in obj]
    if isinstance(obj, dict):
        return {replace_surrogates(k): replace_surrogates(v) for k, v in obj.items()}
    return obj


class _SafeJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            obj = json.loads(body)
            self._json = replace_surrogates(obj) if _ESCAPE.search(body) else obj
        return self._json


class SafeJSONRoute(APIRoute):
    """An APIRoute whose JSON body has no lone surrogates (FastAPI's documented custom-route hook)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_SafeJSONRequest(request.scope, request.receive))

        return route
