"""The lifecycle report renders without a display, for one run and for a --compare pair."""

from __future__ import annotations

import base64
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import pytest  # noqa: E402

from helpers.lifecycle_scenario import record_scenario  # noqa: E402
from minisched.observe.report import figure_size, main, render_report  # noqa: E402
from minisched.observe.run_record import RunRecord, load_runs, save_runs  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs() -> list[RunRecord]:
    small, _ = record_scenario("tiny pool")
    big, _ = record_scenario("bigger pool", num_pages=64)
    return [small, big]


def _size(path) -> tuple[int, int]:
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    assert img.std() > 0.05, "blank image"
    return img.shape[1], img.shape[0]


def test_one_run_png_and_html(runs, tmp_path):
    png, page = tmp_path / "one.png", tmp_path / "one.html"
    render_report(runs[:1], png, html=page)
    assert _size(png) == figure_size(1)
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "tiny pool" in text and "<table>" in text
    data = text.split("data:image/png;base64,", 1)[1].split('"', 1)[0]
    assert base64.b64decode(data) == png.read_bytes()
    assert "TTFT p50 (s)" in text and "retractions" in text


def test_cli_two_runs_side_by_side(runs, tmp_path, capsys):
    """`minisched report run.json -o ... --html ... --trace ...` on a --compare run file."""
    run_file = tmp_path / "run.json"
    save_runs(run_file, runs)
    loaded = load_runs(run_file)
    assert [r.to_dict() for r in loaded] == [json.loads(json.dumps(r.to_dict())) for r in runs]
    out, page, trace = tmp_path / "r.png", tmp_path / "r.html", tmp_path / "t.json"
    assert main([str(run_file), "-o", str(out), "--html", str(page), "--trace", str(trace)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC) and _size(out) == figure_size(2)
    assert figure_size(2)[0] > figure_size(1)[0]
    assert "bigger pool" in page.read_text()
    assert json.loads(trace.read_text())["traceEvents"]
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json")])


def test_empty_run_renders(tmp_path):
    """A run with no requests (e.g. a bench that failed early) still renders."""
    empty = RunRecord("empty", num_pages=8, page_size=4)
    render_report([empty], tmp_path / "e.png")
    assert _size(tmp_path / "e.png") == figure_size(1)
