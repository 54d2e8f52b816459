"""`minisched bench --url`: the CLI's benchmark against a live server, written as a run file that
`minisched report` draws; a server that is not there is one line and exit 2."""

from __future__ import annotations

import json

from helpers.serve import TINY, running_server
from minisched.cli import main
from minisched.engine import Engine


def test_bench_url_writes_a_run_file_the_report_draws(tmp_path, capsys):
    out, png = tmp_path / "http.json", tmp_path / "http.png"
    with running_server(Engine(TINY, num_pages=256)) as live:
        rc = main(
            [
                "bench",
                "--url",
                live.url,
                "--workload",
                "poisson",
                "--num-requests",
                "6",
                "--rate",
                "30",
                "--scale",
                "0.1",
                "--vocab-size",
                "500",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
    text = capsys.readouterr().out
    assert rc == 0 and "6/6 requests" in text and "TTFT" in text
    run = json.loads(out.read_text())["runs"][0]
    assert run["summary"]["completed"] == 6 and run["config"]["client"] == "http"
    assert main(["report", str(out), "-o", str(png)]) == 0 and png.read_bytes().startswith(b"\x89PNG")


def test_bench_url_without_a_server_is_one_line(capsys):
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--num-requests", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "127.0.0.1:9" in err
