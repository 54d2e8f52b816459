"""Prometheus metrics for `GET /metrics` (prometheus-client, one registry per server).

Two sources, neither of which touches the engine from the HTTP side:

- the engine loop's `Stats` snapshot (replaced after every step), read at scrape time by a
  custom collector: running / waiting requests, KV pages used / cached / evictable / free,
  retractions (memory) and preemptions (priority), speculative drafted / accepted tokens, the
  host tier's loads / write-backs / drops, grammar compiles, timeouts and seconds, a histogram of
  compile times, engine steps;
- the HTTP side's own observations at each request's end: TTFT, TPOT (time per output token
  after the first), e2e latency (histograms, seconds, measured from the request's arrival at
  the server), prompt / cached / generated tokens, requests by finish reason, 429s.

`minisched_cache_hit_rate` is cached prompt tokens / prompt tokens over the server's life.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from minisched.engine.structured import COMPILE_TIME_BUCKETS
from minisched.serve.messages import Stats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    def __init__(self, stats: Callable[[], Stats], hit_rate: Callable[[], float]):
        self.stats, self.hit_rate = stats, hit_rate

    def collect(self):
        s = self.stats()
        for name, doc, value in (
            ("minisched_num_requests_running", "requests in the decode batch", s.running),
            ("minisched_num_requests_waiting", "requests waiting for prefill", s.waiting),
            ("minisched_kv_pages_total", "pages in the KV pool", s.pages_total),
            ("minisched_kv_pages_used", "KV pages allocated (requests + cache)", s.pages_total - s.pages_free),
            ("minisched_kv_pages_cached", "KV pages held by the radix cache", s.pages_cached),
            ("minisched_kv_pages_evictable", "radix-cache pages no live request locks", s.pages_evictable),
            ("minisched_kv_pages_free", "free KV pages", s.pages_free),
            ("minisched_cache_hit_rate", "cached prompt tokens / prompt tokens", self.hit_rate()),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        if s.host_pages_total:
            yield GaugeMetricFamily(
                "minisched_host_kv_pages_total", "pages of the host KV tier", value=s.host_pages_total
            )
            yield GaugeMetricFamily(
                "minisched_host_kv_pages_used", "host-tier pages holding cached prefixes", value=s.host_pages_used
            )
            for name, doc, value in (
                ("minisched_host_kv_loads", "cached prefixes loaded back from the host tier", s.host_loads),
                ("minisched_host_kv_load_pages", "pages loaded back from the host tier", s.host_load_pages),
                ("minisched_host_kv_hit_tokens", "prompt tokens found in the host tier", s.host_hit_tokens),
                ("minisched_host_kv_write_back_pages", "pages written back to the host tier", s.host_write_back_pages),
                ("minisched_host_kv_write_backs", "cached prefixes written back to the host tier", s.host_write_backs),
                ("minisched_host_kv_dropped_pages", "host-tier pages evicted or refused room", s.host_dropped_pages),
            ):
                yield CounterMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("minisched_retractions", "requests retracted under KV pressure", value=s.retractions)
        for name, doc, value in (  # vLLM's names: num_preemptions, spec_decode_num_{draft,accepted}_tokens
            ("minisched_num_preemptions", "running requests retracted for a more urgent one", s.preemptions),
            ("minisched_spec_decode_num_draft_tokens", "draft tokens verified", s.spec_draft_tokens),
            ("minisched_spec_decode_num_accepted_tokens", "draft tokens accepted", s.spec_accepted_tokens),
            ("minisched_grammar_compiles", "grammars compiled (cache hits not counted)", s.grammar_compiles),
            (
                "minisched_grammar_compile_timeouts",
                "grammars refused for compiling too long",
                s.grammar_compile_timeouts,
            ),
            ("minisched_grammar_compile_seconds", "seconds spent compiling grammars", s.grammar_compile_seconds),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield _histogram(
            "minisched_grammar_compilation_time_seconds",  # SGLang's sglang:grammar_compilation_time_seconds
            "seconds each grammar compile took (compiled or refused; timeouts are counted apart)",
            COMPILE_TIME_BUCKETS,
            s.grammar_compile_time_counts,
            s.grammar_compile_seconds,
        )
        yield CounterMetricFamily("minisched_engine_steps", "engine steps", value=s.steps)
        yield CounterMetricFamily(
            "minisched_engine_loop_errors", "failed steps and loop errors survived", value=s.step_errors
        )


def _histogram(name: str, doc: str, bounds, counts, total: float) -> HistogramMetricFamily:
    """A histogram from per-bucket counts (the last one past every bound) kept by the engine."""
    counts = list(counts) or [0] * (len(bounds) + 1)
    cumulative, running = [], 0
    for le, c in zip([*map(str, bounds), "+Inf"], counts):
        running += c
        cumulative.append((le, running))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)


class ServerMetrics:
    def __init__(self, stats: Callable[[], Stats]):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "minisched_time_to_first_token_seconds", "arrival to first token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "minisched_time_per_output_token_seconds",
            "mean time per token after the first",
            registry=r,
            buckets=TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "minisched_e2e_request_latency_seconds", "arrival to last token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.prompt_tokens = Counter("minisched_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "minisched_cached_prompt_tokens", "prompt tokens served from the radix cache", registry=r
        )
        self.generation_tokens = Counter("minisched_generation_tokens", "generated tokens", registry=r)
        self.finished = Counter(
            "minisched_requests_finished", "finished requests by OpenAI finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "minisched_requests_rejected", "requests refused before the engine", ["reason"], registry=r
        )
        self._prompt, self._cached = 0, 0
        r.register(_EngineCollector(stats, lambda: self._cached / self._prompt if self._prompt else 0.0))

    def request_done(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        ttft: float | None,
        e2e: float,
        first_token_at: float | None,
        done_at: float,
    ) -> None:
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt += prompt_tokens
        self._cached += cached_tokens
        self.generation_tokens.inc(output_tokens)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
        if first_token_at is not None and output_tokens > 1:
            self.tpot.observe((done_at - first_token_at) / (output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
