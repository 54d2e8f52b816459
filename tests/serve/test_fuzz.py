"""Generated API fuzzing (schemathesis) against the server's own OpenAPI schema, over a dummy:tiny
server: seeded and bounded. Checks: no 5xx, responses that match the declared schema, and a
healthy server with no invariant broken afterwards. The longer run: benchmarks/serving/bench_fuzz.py."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("schemathesis")
from helpers.fuzz import fuzz  # noqa: E402
from helpers.serve import running_server  # noqa: E402
from minisched.engine import Engine  # noqa: E402
from minisched.serve.limits import ServerLimits  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server():
    engine = Engine("dummy:tiny", num_pages=256, max_running_requests=16)
    with running_server(engine, limits=ServerLimits(max_choices_per_request=16)) as live:
        yield live
    assert not live.loop.invariant_errors, live.loop.invariant_errors


def test_generated_requests_get_no_5xx_and_match_the_schema(fuzz_server):
    got = fuzz(fuzz_server.url, max_examples=100, seed=35)
    print(f"\nfuzzing: {got['requests']} generated requests, {len(got['failures'])} failures")
    assert got["requests"] > 50
    assert not got["failures"], got["failures"][:5]
    assert httpx.get(fuzz_server.url + "/health", timeout=5).status_code == 200
