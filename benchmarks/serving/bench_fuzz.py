"""Generated API fuzzing, the long form of tests/serve/test_fuzz.py: schemathesis over the server's
own OpenAPI schema (every route), against a dummy:tiny server in this process, with more examples
per route and several seeds. Prints and writes (default benchmarks/results/fuzz.json) the requests
tried and every failure (a 5xx, a response off the declared schema), and checks the server is
healthy and its scheduler invariants held afterwards.

    .venv/bin/python benchmarks/serving/bench_fuzz.py [--examples 1000] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from helpers.fuzz import fuzz  # noqa: E402
from helpers.serve import running_server  # noqa: E402
from minisched.engine import Engine  # noqa: E402
from minisched.serve.limits import ServerLimits  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000, help="generated cases per route and seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/fuzz.json")
    args = ap.parse_args()
    engine = Engine("dummy:tiny", num_pages=256, max_running_requests=16)
    runs = []
    with running_server(engine, limits=ServerLimits(max_choices_per_request=16)) as live:
        for seed in range(args.seeds):
            t0 = time.monotonic()
            got = fuzz(live.url, max_examples=args.examples, seed=seed)
            runs.append({"seed": seed, "seconds": round(time.monotonic() - t0, 1), **got})
            print(f"seed {seed}: {got['requests']} requests, {len(got['failures'])} failures ({runs[-1]['seconds']} s)")
            for f in got["failures"][:10]:
                print("   ", f)
        healthy = httpx.get(live.url + "/health", timeout=5).status_code == 200
        invariants = list(live.loop.invariant_errors)
    total = sum(r["requests"] for r in runs)
    failures = sum(len(r["failures"]) for r in runs)
    print(
        f"total: {total} requests, {failures} failures; healthy after: {healthy}; invariant errors: {len(invariants)}"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"runs": runs, "healthy": healthy, "invariant_errors": invariants}, f, indent=1, default=str)
    return 0 if healthy and not failures and not invariants else 1


if __name__ == "__main__":
    sys.exit(main())
