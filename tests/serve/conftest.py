"""Fixtures for the serve tests: a module-wide dummy:tiny engine and server (see tests/helpers/serve.py)."""

from __future__ import annotations

import pytest

from helpers.serve import TINY, running_server


@pytest.fixture(scope="module")
def tiny_engine():
    from minisched.engine import Engine

    return Engine(TINY, num_pages=256, max_running_requests=64)


@pytest.fixture(scope="module")
def tiny_server(tiny_engine):
    with running_server(tiny_engine) as live:
        yield live
    assert not live.loop.invariant_errors, live.loop.invariant_errors
