"""The serving benchmark over HTTP: the same workloads as the in-process bench, sent to any
OpenAI-compatible server (minisched serve, vLLM, SGLang) and measured on the client side.

    summary, record = run_http_bench("http://127.0.0.1:30000", make_workload("poisson", 64, 4.0))
    save_runs("run.json", [record])       # `minisched report run.json -o report.png` draws it

Each request is a streaming `POST /v1/completions` with the workload's token-id prompt,
`max_tokens`, `temperature: 0`, `ignore_eos: true` (a vLLM / SGLang / minisched extension that
forces the output length) and `stream_options.include_usage`, sent at its Poisson arrival time
(one connection per request). Measured per request, in seconds from its scheduled arrival:
TTFT (first streamed choice), e2e (the `[DONE]`), TPOT ((e2e - TTFT) / (tokens - 1)) and
the inter-token latencies (gaps between streamed chunks; a server that coalesces tokens
sends fewer, larger gaps). Output tokens and cached prompt tokens come from the final
`usage` (streamed chunks are counted when a server sends none).

`api="generate"` sends SGLang's `POST /generate` instead (`input_ids`, `sampling_params` with
`ignore_eos`, `stream`; cumulative `output_ids`, `meta_info.cached_tokens`): the one route that
takes token ids through sglang-router. `run_http_conversations` runs multi-turn chats
(`make_conversations`) closed loop over /generate: each turn's prompt carries the replies' ids.

The summary has the in-process bench's keys (`minisched.observe.workloads.summarize`) plus
`itl_s`, `failed` and `errors`; server-side quantities it cannot see (scheduler share,
retractions) are 0. The RunRecord's lifecycle is the client's view: waiting until the first
token (queueing and prefill together), then decoding, then finished (or aborted on an error).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import httpx

from minisched.observe.run_record import RunRecord
from minisched.observe.workloads import BenchRequest, Conversation, RequestResult, RunResult, percentiles, summarize
from minisched.sched.events import Event
from minisched.sched.req import ReqStatus


@dataclass
class _Trace:
    sent: Optional[float] = None
    first: Optional[float] = None
    chunks: list[float] = field(default_factory=list)
    done: Optional[float] = None
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    error: Optional[str] = None
    output_ids: list[int] = field(default_factory=list)  # /generate only: the conversation goes on with them


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _first_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError("the server lists no models (GET /v1/models)")
    return data[0]["id"]


async def _one(
    client: httpx.AsyncClient,
    model: str,
    br: BenchRequest,
    start: float,
    tr: _Trace,
    api: str,
    slots: Optional[asyncio.Semaphore],
) -> None:
    await asyncio.sleep(max(0.0, start + br.arrival - time.monotonic()))
    if slots is None:
        await _request(client, api, model, list(br.prompt_ids), br.max_new_tokens, tr)
        return
    async with slots:
        await _request(client, api, model, list(br.prompt_ids), br.max_new_tokens, tr)


async def _request(
    client: httpx.AsyncClient, api: str, model: str, prompt_ids: list[int], max_new_tokens: int, tr: _Trace
) -> None:
    """One streamed request; fills `tr` (an error instead of raising)."""
    if api == "completions":
        path = "/v1/completions"
        body: dict = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    else:
        path = "/generate"
        body = {
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
    tr.sent = time.monotonic()
    chunk_tokens = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                tr.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    tr.done = time.monotonic()
                    break
                msg = json.loads(data)
                if "error" in msg:
                    err = msg["error"]
                    tr.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
                    return
                now = time.monotonic()
                if api == "generate":  # SGLang's stream: cumulative output_ids, meta_info on every event
                    ids = msg.get("output_ids") or []
                    if len(ids) > len(tr.output_ids):
                        tr.first = now if tr.first is None else tr.first
                        tr.chunks.append(now)
                        tr.output_ids = list(ids)
                    meta = msg.get("meta_info") or {}
                    if meta.get("finish_reason") is not None:
                        tr.finish_reason = str(meta["finish_reason"].get("type", ""))
                        tr.output_tokens = meta.get("completion_tokens", len(ids))
                        tr.cached_tokens = meta.get("cached_tokens", 0) or 0
                    continue
                for ch in msg.get("choices") or []:
                    if tr.first is None:
                        tr.first = now
                    tr.chunks.append(now)
                    chunk_tokens += 1
                    tr.finish_reason = ch.get("finish_reason") or tr.finish_reason
                usage = msg.get("usage")
                if usage:
                    tr.output_tokens = usage.get("completion_tokens", 0)
                    tr.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    except httpx.HTTPError as exc:
        tr.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    if tr.done is None:
        tr.error = "the stream ended without [DONE]"
    elif not tr.output_tokens:
        tr.output_tokens = chunk_tokens or len(tr.output_ids)


APIS = ("completions", "generate")


def _client(url: str, api_key: Optional[str], connections: int, timeout: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=connections)
    return httpx.AsyncClient(
        base_url=_base(url), headers=headers, limits=limits, timeout=httpx.Timeout(timeout, connect=30.0)
    )


async def _run(
    url: str,
    workload: list[BenchRequest],
    model: Optional[str],
    api_key: Optional[str],
    progress: Optional[Callable[[dict], None]],
    timeout: float,
    api: str,
    concurrency: Optional[int],
) -> tuple[str, float, float, list[_Trace]]:
    async with _client(url, api_key, len(workload), timeout) as client:
        model = model or await _first_model(client)
        traces = [_Trace() for _ in workload]
        slots = None if concurrency is None else asyncio.Semaphore(concurrency)
        start = time.monotonic()
        tasks = [
            asyncio.ensure_future(_one(client, model, br, start, tr, api, slots)) for br, tr in zip(workload, traces)
        ]
        if progress is not None:
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=0.25)
                done = sum(t.done() for t in tasks)
                sent = sum(tr.sent is not None for tr in traces)
                progress(
                    {
                        "elapsed": time.monotonic() - start,
                        "done": done,
                        "total": len(tasks),
                        "running": sent - done,
                        "waiting": len(tasks) - sent,
                    }
                )
        await asyncio.gather(*tasks)
        return model, start, time.monotonic(), traces


def _check_api(api: str) -> None:
    if api not in APIS:
        raise ValueError(f"unknown api {api!r}; expected one of {APIS}")


def run_http_bench(
    url: str,
    workload: list[BenchRequest],
    model: Optional[str] = None,
    api_key: Optional[str] = None,
    progress: Optional[Callable[[dict], None]] = None,
    name: str = "http",
    timeout: float = 600.0,
    api: str = "completions",
    concurrency: Optional[int] = None,
) -> tuple[dict, RunRecord]:
    """Replay `workload` against the OpenAI-compatible server at `url` (with or without /v1);
    `model`: default the first of GET /v1/models. `api="generate"` sends SGLang's `POST /generate`
    with `input_ids` instead (the only token-id route through sglang-router). `concurrency` N: at
    most N requests in flight (N streams, closed loop): a request waits for its arrival time and
    then for a free stream, and its latencies count from when it was sent. Returns (summary, RunRecord)."""
    _check_api(api)
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    model, start, end, traces = asyncio.run(_run(url, workload, model, api_key, progress, timeout, api, concurrency))
    pairs = list(zip(workload, traces))
    if concurrency is not None:  # closed loop: a request arrives when a stream sends it
        pairs = [(_sent_at(br, tr, start, end), tr) for br, tr in pairs]
    return _summarize(url, model, name, start, end, pairs)


def _sent_at(br: BenchRequest, tr: _Trace, start: float, end: float) -> BenchRequest:
    return dataclasses.replace(br, arrival=(tr.sent if tr.sent is not None else end) - start)


def run_http_conversations(
    url: str,
    conversations: list[Conversation],
    model: Optional[str] = None,
    api_key: Optional[str] = None,
    name: str = "conversations",
    timeout: float = 600.0,
    api: str = "generate",
) -> tuple[dict, RunRecord]:
    """Multi-turn chats, closed loop: every conversation at once (one stream each), each turn sent when
    the one before it has finished; turn t's prompt is the conversation so far (every earlier turn's
    user tokens and reply tokens) + its own user tokens, so a server that kept the conversation's KV
    serves all but the new tokens from its cache. Needs the reply's token ids: `api="generate"`.
    A turn's arrival is when it was sent. The summary adds `later_turn_hit_rate` (turns after the
    first: the ones a cache can serve). A failed turn ends its conversation (the rest count as failed)."""
    _check_api(api)
    if api != "generate":
        raise ValueError("run_http_conversations needs the reply's token ids: api='generate'")

    async def chat(client: httpx.AsyncClient, model: str, conv: Conversation, start: float, out: list) -> None:
        await asyncio.sleep(max(0.0, start + conv.start - time.monotonic()))
        history: list[int] = []
        for t, (user, max_new) in enumerate(conv.turns):
            history += user
            tr = _Trace()
            prompt = list(history)
            out.append((t, prompt, max_new, tr))
            if out[:-1] and out[-2][3].error is not None:
                tr.error = "not sent: an earlier turn of the conversation failed"
                continue
            await _request(client, api, model, prompt, max_new, tr)
            history += tr.output_ids

    async def go() -> tuple[str, float, float, list[list]]:
        async with _client(url, api_key, len(conversations), timeout) as client:
            m = model or await _first_model(client)
            outs: list[list] = [[] for _ in conversations]
            start = time.monotonic()
            await asyncio.gather(*(chat(client, m, c, start, o) for c, o in zip(conversations, outs)))
            return m, start, time.monotonic(), outs

    model, start, end, outs = asyncio.run(go())
    pairs = []
    for conv, turns in zip(conversations, outs):
        for t, prompt, max_new, tr in turns:
            pairs.append((_sent_at(BenchRequest(f"{conv.cid}-t{t}", tuple(prompt), max_new, 0.0), tr, start, end), tr))
    summary, record = _summarize(url, model, name, start, end, pairs)
    later = [(br, tr) for br, tr in pairs if not br.rid.endswith("-t0") and tr.error is None]
    prompt = sum(len(br.prompt_ids) for br, _ in later)
    summary["later_turn_hit_rate"] = sum(tr.cached_tokens for _, tr in later) / prompt if prompt else 0.0
    return summary, record


def _summarize(
    url: str, model: str, name: str, start: float, end: float, pairs: list[tuple[BenchRequest, _Trace]]
) -> tuple[dict, RunRecord]:
    results, events, itl = [], [], []
    for br, tr in pairs:
        ok = tr.error is None
        arrival = br.arrival
        first = tr.first - start if ok and tr.first is not None else None
        finish = tr.done - start if ok and tr.done is not None else None
        results.append(
            RequestResult(
                rid=br.rid,
                prompt_tokens=len(br.prompt_ids),
                output_tokens=tr.output_tokens if ok else 0,
                arrival=arrival,
                first_token=first,
                finish=finish,
                cached_tokens=tr.cached_tokens,
            )
        )
        itl += [b - a for a, b in zip(tr.chunks, tr.chunks[1:])] if ok else []
        events += _events(br, tr, start)
    run = RunResult(
        name=name, requests=results, duration=end - start, start=start, step_time=0.0, retractions=0, scheduler_time=0.0
    )
    summary = summarize(run)
    failed = [tr.error for _, tr in pairs if tr.error is not None]
    summary.update(itl_s=percentiles(itl), failed=len(failed), errors=sorted(set(failed))[:5], url=url, model=model)
    config = {
        "client": "http",
        "url": url,
        "model": model,
        "mode": name,
        "lifecycle": "client view: waiting = time to first token (queue + prefill)",
    }
    record = RunRecord.from_events(
        name, sorted(events, key=lambda e: e.time), [], 0, 0, config=config, summary=summary, start_time=start
    )
    return summary, record


def _events(br: BenchRequest, tr: _Trace, start: float) -> list[Event]:
    """The client's view of one request as lifecycle events (absolute times)."""
    n, arrival = len(br.prompt_ids), start + br.arrival

    def event(time, src, dst, output_len=0, kv_len=0, cached_len=0, note=""):
        return Event(
            time=time,
            step=0,
            rid=br.rid,
            src=src,
            dst=dst,
            prompt_len=n,
            output_len=output_len,
            kv_len=kv_len,
            cached_len=cached_len,
            note=note,
        )

    out = [event(arrival, None, ReqStatus.WAITING)]
    if tr.error is not None:
        end = max(tr.first or arrival, tr.sent or arrival)
        return out + [event(end, ReqStatus.WAITING, ReqStatus.ABORTED, note="error")]
    done = tr.done
    if done is None:  # _request sets an error on a stream that ended without [DONE]
        raise ValueError(f"request {br.rid}: the trace has neither an error nor an end")
    first = tr.first if tr.first is not None else done
    out += [
        event(first, ReqStatus.WAITING, ReqStatus.PREFILLING, cached_len=tr.cached_tokens),
        event(first, ReqStatus.PREFILLING, ReqStatus.RUNNING, 1, n, tr.cached_tokens),
        event(done, ReqStatus.RUNNING, ReqStatus.FINISHED, tr.output_tokens, n, tr.cached_tokens, tr.finish_reason),
    ]
    return out
