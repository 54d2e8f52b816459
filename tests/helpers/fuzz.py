"""Generated API fuzzing with schemathesis over a live server's own OpenAPI schema (tests/serve/test_fuzz.py,
benchmarks/serving/bench_fuzz.py)."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings


def _checks():
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi import checks as oc

    # the response side only: bodies the schema allows may still be refused by a runtime bound (limits.py,
    # the vocabulary, the context), so "schema-valid data accepted" is not a check this API can pass
    return [
        not_a_server_error,
        oc.status_code_conformance,
        oc.content_type_conformance,
        oc.response_schema_conformance,
    ]


CHECKS = _checks()


def fuzz(url: str, max_examples: int, seed: int) -> dict:
    """Every operation of the server's schema, `max_examples` generated cases each (seeded); returns
    {"requests": n, "failures": [...]} where a failure is a 5xx or a response off the schema."""
    from hypothesis import given
    from hypothesis import seed as hseed

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    out = {"requests": 0, "failures": []}
    for result in schema.get_all_operations():
        op = result.ok()

        @hseed(seed)
        @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            out["requests"] += 1
            r = case.call(base_url=url, timeout=30)
            if r.status_code >= 500:
                out["failures"].append((op.label, r.status_code, r.text[:300]))
                return
            try:
                case.validate_response(r, checks=CHECKS)
            except Exception as exc:  # noqa: BLE001 -- recorded, reported by the caller
                out["failures"].append((op.label, r.status_code, str(exc)[:300]))

        run()
    return out
