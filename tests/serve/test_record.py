"""`minisched serve --record` over HTTP (dummy:tiny in engine processes):
- a real `minisched serve --dp 2 --record PATH` process (and one with its engine in process): requests with
  X-Request-Id, SIGTERM; each replica wrote a series of its own, which `minisched replay` finds identical and predicts under another policy,
  and `minisched explain FILE --request <client id>` tells that request's story;
- a killed engine process is restarted with a series of its own: the earlier files are left as they were.
Bounded: every wait has a deadline; 127.0.0.1 only."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from helpers.record import cli
from helpers.serve import pool_server, wait_for
from minisched.engine import Engine
from minisched.observe.record_series import MIN_MAX_BYTES, RecordOptions, SeriesRecorder
from minisched.observe.run_record import load_runs
from minisched.serve.pool import Supervision

LAUNCH = (
    "import argparse, sys\n"
    "from minisched.cli.serve import add_parser, cmd_serve\n"
    "p = argparse.ArgumentParser(); add_parser(p.add_subparsers(dest='command'))\n"
    "sys.exit(cmd_serve(p.parse_args(sys.argv[1:])))\n"
)


def complete(url: str, client_id: str, prompt: str, max_tokens: int = 6) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        headers={"X-Request-Id": client_id},
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == client_id, r.text
    return r.json()


@pytest.mark.parametrize(
    "layout",
    [
        # three Python processes importing torch: ~30 s on a busy 2-core machine (the restart test below
        # covers an engine process's recorder in the fast tier)
        pytest.param(["--dp", "2", "--router", "round-robin"], marks=pytest.mark.slow, id="dp2"),
        pytest.param(["--engine-in-process"], id="in-process"),
    ],
)
def test_serve_record_over_http_replays_and_explains_by_client_id(layout, tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    base = tmp_path / "serve.json"
    argv = ["serve", *layout, "--model", "dummy:tiny", "--served-model-name", "tiny"]
    argv += ["--num-pages", "64", "--page-size", "4", "--chunk-size", "16", "--port", str(port)]
    argv += ["--log-level", "warning", "--record", str(base), "--record-interval", "0.2"]
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, *argv], start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(url), 120, "the server")
        assert proc.poll() is None, "the server did not start"
        ids = {}
        for k in range(6):  # --dp 2, round-robin: three calls on each replica
            ids[f"client-{k}"] = complete(url, f"client-{k}", f"tell me about {k} " * (3 + k))["id"]
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    options = RecordOptions(str(base))
    for replica in range(2 if "--dp" in layout else 1):
        files = options.replica_files(replica)
        assert files, f"replica {replica} wrote no record"
        runs = [load_runs(p)[0] for p in files]
        assert len({r.config["record"]["series"] for r in runs}) == 1  # one engine process, one series
        rc, out, err = cli(["replay", *files], capsys)
        assert rc == 0 and out.startswith("identical, "), out + err
        rc, out, err = cli(["replay", *files, "--policy", "lpm", "--num-pages", "32"], capsys)
        assert rc == 0 and "policy=lpm" in out and "TTFT p50" in out, err
        for client in {c for r in runs for c in r.client_ids}:
            path = next(p for p, r in zip(files, runs) if client in r.client_ids)
            rc, out, err = cli(["explain", path, "--request", client], capsys)
            assert rc == 0, err
            assert out.startswith(f"{ids[client]}-0:") and "arrived" in out and "finished" in out, out
            ids.pop(client)
    assert not ids, f"client ids in no record file: {sorted(ids)}"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


TINY = functools.partial(Engine, "dummy:tiny", num_pages=128, chunk_size=8, page_size=4)
FAST = Supervision(heartbeat_timeout=2.0, step_timeout=60.0, max_restarts=3, retry_wait=60.0)


def test_a_restarted_engine_records_a_new_series_and_overwrites_nothing(tmp_path, capsys):
    options = RecordOptions(str(tmp_path / "serve.json"), max_bytes=MIN_MAX_BYTES, keep=100, interval=0.1)
    recorder = functools.partial(SeriesRecorder, options)
    with pool_server([TINY], supervision=FAST, recorder=recorder) as (url, pool):
        for k in range(3):
            complete(url, f"before-{k}", f"first life {k}")
        wait_for(lambda: _clients(options) >= {f"before-{k}" for k in range(3)}, 30, "the first series' files")
        pid = pool.replicas[0].process.pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: pool.replicas[0].process.pid != pid and pool.is_alive(), 90, "the restarted engine")
        before = {p: p.read_bytes() for p in options.replica_files(0)}  # the dead process writes no more
        for k in range(3):
            complete(url, f"after-{k}", f"second life {k}")
        wait_for(lambda: _clients(options) >= {f"after-{k}" for k in range(3)}, 30, "the second series' files")
    files = options.replica_files(0)
    assert all(p in files and p.read_bytes() == data for p, data in before.items())
    series = {load_runs(p)[0].config["record"]["series"]: p for p in files}
    assert len(series) == 2
    for name in series:  # each series replays on its own, from its engine's birth
        mine = [p for p in files if name in p.name]
        rc, out, err = cli(["replay", *mine], capsys)
        assert rc == 0 and out.startswith("identical, "), out + err


def _clients(options: RecordOptions) -> set[str]:
    out: set[str] = set()
    for p in options.replica_files(0):
        try:
            out |= set(load_runs(p)[0].client_ids)
        except (OSError, ValueError):  # replaced while read
            continue
    return out
