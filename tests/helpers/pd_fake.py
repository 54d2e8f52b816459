"""A logging fake of an SGLang worker in PD mode, for reading what sglang-router sends each side.

    python tests/helpers/pd_fake.py --role prefill --port 40001 [--served-model-name tiny]

It records every request (method, path, the JSON body) and answers in SGLang's shapes: /health,
/server_info, /model_info, /get_load, /v1/models, and /generate, /v1/completions and
/v1/chat/completions, streamed (SSE, `data: [DONE]` last) or not. What it generates names its role,
so a test sees which side's answer reached the client: text `<role>:<n>` (n: the prompt's index in a
batch), output ids `[ROLE_ID, n]` (ROLE_ID 100 for prefill, 200 for decode). With `return_logprob`
the prefill side reports one input-token logprob per prompt token (`[-0.5, id, None]`) and the decode
side one marker row (`[-9.0, 999, None]`): the router's merge (prefill's rows, then decode's) is
visible in what the client gets.

GET /_recorded answers the requests recorded so far ([{"method", "path", "body"}], oldest first);
DELETE /_recorded forgets them. POST /_control sets how it answers the generation routes from then on:
`{"fail_status": 503, "fail_count": 1}` answers the next fail_count of them with that status (an SGLang
error body), `{"delay": 1.0}` answers each after that many seconds, `{"stream_as_json": true}` answers a streamed request with one JSON body instead of SSE
(what a prefill worker may do: the router reads the prefill side's answer whole). Run it with the main
venv's python (fastapi, uvicorn).

`start_fake(role, tmp)` starts one (a fleet `Proc`), `start_pd_router(py, prefill, bootstrap_port,
decode, tmp)` the real router in PD mode in front of them (tests/serve/test_pd_protocol.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from minisched.observe.fleet import Proc, free_port, spawn

ROLE_ID = {"prefill": 100, "decode": 200}
PROMPT_TOKENS = 3  # every prompt counts as 3 tokens: ids 1, 2, 3
DECODE_MARK = [-9.0, 999, None]


def _prompts(body: dict) -> tuple[int, bool]:
    """(number of prompts, batched?) of a /generate body: text or input_ids, one or a list."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text), True
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids), True
    return 1, False


def _meta(role: str, i: int, body: dict, n_out: int) -> dict:
    meta: dict[str, Any] = {
        "id": f"{role}-{i}",
        "finish_reason": {"type": "length", "length": n_out},
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": n_out,
        "cached_tokens": 0,
    }
    if body.get("return_logprob"):
        rows = [[-0.5, t, None] for t in range(1, PROMPT_TOKENS + 1)] if role == "prefill" else [DECODE_MARK]
        meta["input_token_logprobs"] = rows
        meta["output_token_logprobs"] = [[-0.25, ROLE_ID[role], None]]
    return meta


def _generate_one(role: str, i: int, body: dict) -> dict:
    return {"text": f"{role}:{i}", "output_ids": [ROLE_ID[role], i], "meta_info": _meta(role, i, body, 2)}


def _sse(events: list[Any]) -> StreamingResponse:
    def lines():
        for ev in events:
            yield f"data: {json.dumps(ev)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def _completion(role: str, body: dict, chat: bool) -> dict:
    n_prompts = len(body["prompt"]) if not chat and isinstance(body.get("prompt"), list) else 1
    n = body.get("n") or 1
    choices = []
    for i in range(n_prompts * n):
        text = f"{role}:{i}"
        if chat:
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                    "logprobs": None,
                }
            )
        else:
            choices.append({"index": i, "text": text, "finish_reason": "length", "logprobs": None})
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2, "total_tokens": PROMPT_TOKENS + 2}
    obj = "chat.completion" if chat else "text_completion"
    return {
        "id": f"{role}-cmpl",
        "object": obj,
        "created": 0,
        "model": body.get("model"),
        "choices": choices,
        "usage": usage,
    }


def _completion_chunks(role: str, body: dict, chat: bool) -> list[dict]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    key = "delta" if chat else "text"
    chunks = []
    for piece in (f"{role}:", "0"):
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        choice[key] = {"content": piece} if chat else piece
        chunks.append(
            {"id": f"{role}-cmpl", "object": obj, "created": 0, "model": body.get("model"), "choices": [choice]}
        )
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    return chunks


def make_app(role: str, served_model_name: str) -> FastAPI:
    app = FastAPI()
    recorded: list[dict] = []
    control: dict[str, Any] = {"fail_status": 0, "fail_count": 0, "stream_as_json": False, "delay": 0.0}

    def failing() -> JSONResponse | None:
        if control["fail_count"] <= 0:
            return None
        control["fail_count"] -= 1
        status = control["fail_status"]
        return JSONResponse({"error": {"message": f"{role} fails on purpose", "code": status}}, status_code=status)

    def streamed(body: dict) -> bool:
        return bool(body.get("stream")) and not control["stream_as_json"]

    @app.middleware("http")
    async def record(request: Request, call_next):
        if request.url.path != "/_recorded":
            raw = await request.body()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            recorded.append({"method": request.method, "path": request.url.path, "body": body})
        return await call_next(request)

    @app.get("/_recorded")
    async def _recorded():
        return recorded

    @app.delete("/_recorded")
    async def _forget():
        recorded.clear()
        return {"ok": True}

    @app.post("/_control")
    async def _control(request: Request):
        control.update(await request.json())
        return control

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return {"served_model_name": served_model_name, "dp_size": 1, "version": "pd-fake", "disaggregation_mode": role}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": served_model_name, "is_generation": True, "model_type": "llama", "architectures": ["X"]}

    @app.get("/get_load")
    async def get_load():
        return [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "owned_by": "pd-fake"}]}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        await asyncio.sleep(control["delay"])
        n, batched = _prompts(body)
        outs = [_generate_one(role, i, body) for i in range(n)]
        if (error := failing()) is not None:
            return error
        if streamed(body):
            return _sse(outs)
        return JSONResponse(outs if batched else outs[0])

    async def openai(request: Request, chat: bool):
        body = await request.json()
        await asyncio.sleep(control["delay"])
        if (error := failing()) is not None:
            return error
        return _sse(_completion_chunks(role, body, chat)) if streamed(body) else _completion(role, body, chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai(request, False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await openai(request, True)

    return app


def start_fake(role: str, tmp: Path, served_model_name: str = "tiny") -> Proc:
    port = free_port()
    # -I: the script's folder (tests/helpers/: serve.py, model.py, ...) stays off sys.path
    argv = [sys.executable, "-I", __file__, "--role", role, "--port", str(port)]
    argv += ["--served-model-name", served_model_name]
    return spawn(f"fake-{role}", argv, port, tmp)


def start_pd_router(
    py: str, prefill: Proc, bootstrap_port: Optional[int], decode: Proc, tmp: Path, *extra: str, name: str = "router-pd"
) -> Proc:
    """sglang-router in PD mode (`--prefill URL [BOOTSTRAP_PORT] --decode URL`), fast health checks,
    short retry backoffs (a retried request shows up on the fakes within milliseconds); `extra`: more
    router options (a later one overrides the same option here)."""
    port = free_port()
    argv = [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--pd-disaggregation", "--prefill", prefill.url, *([str(bootstrap_port)] if bootstrap_port else [])]
    argv += ["--decode", decode.url, "--policy", "round_robin"]
    argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    argv += ["--health-success-threshold", "1", "--health-check-timeout-secs", "1"]
    argv += ["--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1", "--log-level", "warn"]
    argv += ["--retry-initial-backoff-ms", "10", "--retry-max-backoff-ms", "50"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return spawn(name, [*argv, *extra], port, tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=sorted(ROLE_ID), required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model-name", default="tiny")
    args = ap.parse_args()
    uvicorn.run(make_app(args.role, args.served_model_name), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
