"""The lifecycle report: one PNG (and optionally a self-contained HTML page) per run file.

For each run, a column of panels sharing the time axis:

1. batch steps: one strip, colored by the step's mode (prefill / decode / mixed);
2. the lifecycle Gantt chart: one row per request (arrival order, top to bottom), colored
   by state — waiting, prefill chunks, chunk paused (a chunked prompt between its
   chunks), decode, retracted (waiting again after a retraction) — with marks for retract, finished and aborted;
3. KV pages over time, stacked: in use by requests, evictable radix cache, free;
4. queue depth: running (decode batch) and waiting requests;
5. TTFT and end-to-end latency distributions (empirical CDFs).

With two runs (a `--compare` bench) the columns sit side by side on the same axes.
Command line: `minisched report run.json -o report.png [--html report.html] [--trace t.json]`.
"""

from __future__ import annotations

import argparse
import base64
import html as html_lib
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from minisched.observe.explain import story_texts
from minisched.observe.paths import unwritable  # noqa: E402
from minisched.observe.run_record import RunRecord, derived_summary, lifecycle_segments, load_runs, step_bounds  # noqa: E402

STATE_COLORS = {
    "waiting": "#c9c9c9",
    "prefill": "#2f6fd6",
    "chunk paused": "#a8c5f0",
    "decode": "#4caf50",
    "retracted": "#f39c35",
}
MARK_STYLES = {  # kind: (marker, color, label)
    "retract": ("v", "#c0392b", "retract (KV freed)"),
    "finished": ("|", "#111111", "finished"),
    "aborted": ("X", "#d62728", "aborted"),
}
MODE_COLORS = {"prefill": "#2f6fd6", "decode": "#4caf50", "mixed": "#8e44ad"}
KV_COLORS = ("#e4572e", "#f3c969", "#dfe7ee")  # in use, evictable cache, free
COLUMN_IN, HEIGHT_IN, DPI = 10.0, 13.0, 100


def figure_size(n_runs: int) -> tuple[int, int]:
    """The PNG's (width, height) in pixels for n_runs columns."""
    return int(round((COLUMN_IN * n_runs + 1.0) * DPI)), int(round(HEIGHT_IN * DPI))


def _time_unit(runs: list[RunRecord]) -> tuple[str, float]:
    longest = max((r.duration for r in runs), default=0.0)
    return ("s", 1.0) if longest >= 2.0 else ("ms", 1e3)


def _draw_steps(ax, record: RunRecord, scale: float) -> None:
    for mode, color in MODE_COLORS.items():
        spans = [(a * scale, (b - a) * scale) for s, a, b in step_bounds(record) if s["mode"] == mode]
        if spans:
            ax.broken_barh(
                spans,
                (0, 1),
                facecolors=color,
                edgecolor="white",
                linewidth=0.5 if len(record.step_stats) <= 150 else 0,
            )
    ax.set_yticks([])
    ax.set_ylim(0, 1)
    ax.set_ylabel("step", rotation=0, ha="right", va="center")


def _draw_gantt(ax, record: RunRecord, scale: float, n_rows: int) -> None:
    segs = lifecycle_segments(record)
    edge = dict(edgecolor="white", linewidth=0.4) if len(segs) <= 60 else dict(linewidth=0)
    for state, color in STATE_COLORS.items():
        rows, lefts, widths = [], [], []
        for row, seg in enumerate(segs):
            for st, a, b, _ in seg["slices"]:
                if st == state:
                    rows.append(row)
                    lefts.append(a * scale)
                    widths.append((b - a) * scale)
        if rows:
            ax.barh(rows, widths, left=lefts, height=0.8, color=color, **edge)
    for kind, (marker, color, _) in MARK_STYLES.items():
        pts = [(t * scale, row) for row, seg in enumerate(segs) for k, t, _ in seg["marks"] if k == kind]
        if pts:
            xs, ys = zip(*pts)
            size = (60 if kind == "finished" else 30) * min(1.0, max(0.15, 40 / max(n_rows, 1)))
            ax.scatter(xs, ys, marker=marker, color=color, s=size, zorder=3, linewidths=1.5)
    ax.set_ylim(max(n_rows, 1) - 0.5, -0.5)
    if len(segs) <= 40:
        ax.set_yticks(range(len(segs)))
        ax.set_yticklabels([s["key"] for s in segs], fontsize=8)
    ax.set_ylabel("request (arrival order)")
    ax.grid(axis="x", alpha=0.3)


def _step_series(record: RunRecord, scale: float, key) -> tuple[list[float], list[float]]:
    xs = [s["time"] * scale for s in record.step_stats]
    ys = [key(s) for s in record.step_stats]
    if record.step_stats:  # hold the last value to the run's end
        xs.append(record.duration * scale)
        ys.append(ys[-1])
    return xs, ys


# Panels whose data can reach the top get this much headroom, and their legend sits in it as one
# row: a legend never covers data.
HEADROOM = 1.4


def _legend(ax, loc: str, ncol: int = 1) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc=loc, fontsize=7, framealpha=0.8, ncol=ncol)


def _draw_kv(ax, record: RunRecord, scale: float) -> None:
    total = record.num_pages
    xs, used = _step_series(record, scale, lambda s: total - s["free_pages"] - s["evictable_pages"])
    _, evict = _step_series(record, scale, lambda s: s["evictable_pages"])
    _, free = _step_series(record, scale, lambda s: s["free_pages"])
    if xs:
        ax.stackplot(
            xs,
            used,
            evict,
            free,
            colors=KV_COLORS,
            step="post",
            labels=["in use by requests", "evictable radix cache", "free"],
        )
    ax.set_ylim(0, max(total, 1) * HEADROOM)
    ax.set_ylabel(f"KV pages (of {total})")
    _legend(ax, "upper center", ncol=3)


def _draw_queue(ax, record: RunRecord, scale: float) -> None:
    for key, color, label in (
        ("num_running", STATE_COLORS["decode"], "running (decode batch)"),
        ("num_waiting", "#7f7f7f", "waiting queue"),
    ):
        xs, ys = _step_series(record, scale, lambda s, k=key: s[k])
        ax.step(xs, ys, where="post", color=color, label=label, linewidth=1.6)
    ax.set_ylabel("requests")
    top = max((max(s["num_running"], s["num_waiting"]) for s in record.step_stats), default=1)
    ax.set_ylim(0, top * HEADROOM + 0.5)
    _legend(ax, "upper center", ncol=2)
    ax.grid(alpha=0.3)


def _ecdf(ax, values: list[float], color: str, label: str) -> None:
    vals = sorted(values)
    if not vals:
        return
    n = len(vals)
    ax.step(
        [0.0] + vals,
        [0.0] + [(i + 1) / n for i in range(n)],
        where="post",
        color=color,
        linewidth=1.8,
        label=f"{label} (n={n}, p50 {vals[(n - 1) // 2]:.3g})",
    )


def _draw_latency(ax, record: RunRecord, scale: float, unit: str) -> None:
    reqs = record.requests
    _ecdf(ax, [r["ttft"] * scale for r in reqs if r["ttft"] is not None], STATE_COLORS["prefill"], "TTFT")
    _ecdf(
        ax,
        [r["e2e_latency"] * scale for r in reqs if r["status"] == "finished" and r["e2e_latency"] is not None],
        "#111111",
        "e2e latency",
    )
    ax.set_xlabel(f"latency ({unit})")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    _legend(ax, "lower right")


def _title(record: RunRecord) -> str:
    d = derived_summary(record)
    tps = d["output tok/s"]
    parts = [
        f"{d['requests']} requests",
        f"{d['finished']} finished",
        f"{d['aborted']} aborted",
        f"{d['retractions']} retractions",
        f"{d['steps']} steps",
    ]
    if tps is not None:
        parts.append(f"{tps:.1f} output tok/s")
    return f"{record.name}\n" + ", ".join(parts)


def _legend_handles() -> list:
    handles: list[Artist] = [
        Patch(color=c, label=("retracted (waiting again)" if s == "retracted" else s)) for s, c in STATE_COLORS.items()
    ]
    handles += [
        Line2D([], [], marker=m, color=c, linestyle="", markersize=8, markeredgewidth=1.5, label=lab)
        for m, c, lab in MARK_STYLES.values()
    ]
    handles += [Patch(color=MODE_COLORS["mixed"], label="mixed step")]
    return handles


def render_figure(runs: list[RunRecord]):
    """The report's matplotlib Figure (1 column per run, shared axes)."""
    if not runs:
        raise ValueError("render_report needs at least one run")
    unit, scale = _time_unit(runs)
    w, h = figure_size(len(runs))
    fig = plt.figure(figsize=(w / DPI, h / DPI), dpi=DPI)
    # room for the longest request label left of the first Gantt chart (~0.06 in per 8-pt character)
    longest = max((len(str(r.get("rid", ""))) for rec in runs for r in rec.requests), default=0)
    left_in = max(0.7, 0.35 + 0.062 * longest)
    grid = fig.add_gridspec(
        5,
        len(runs),
        height_ratios=[0.35, 6.0, 1.8, 1.6, 2.2],
        hspace=0.32,
        wspace=0.18,
        left=left_in / (w / DPI),
        right=0.985,
        top=0.885,
        bottom=0.05,
    )
    n_rows = max(len(r.requests) for r in runs)
    t_max = max(r.duration for r in runs) * scale
    columns = [[fig.add_subplot(grid[row, col]) for row in range(5)] for col in range(len(runs))]
    for col, (rec, axes) in enumerate(zip(runs, columns)):
        steps_ax, gantt_ax, kv_ax, queue_ax, lat_ax = axes
        for row, ax in enumerate(axes):  # one time axis everywhere; same y axes across runs
            ref = columns[0][4] if row == 4 else columns[0][1]
            if ax is not ref:
                ax.sharex(ref)
            if col > 0 and row > 1:  # the Gantt rows keep their own rid labels, same limits
                ax.sharey(columns[0][row])
        _draw_steps(steps_ax, rec, scale)
        _draw_gantt(gantt_ax, rec, scale, n_rows)
        _draw_kv(kv_ax, rec, scale)
        _draw_queue(queue_ax, rec, scale)
        _draw_latency(lat_ax, rec, scale, unit)
        steps_ax.set_title(_title(rec), fontsize=11)
        for ax in (steps_ax, kv_ax):
            ax.tick_params(labelbottom=False)
        gantt_ax.tick_params(labelbottom=True)
        queue_ax.set_xlabel(f"time since run start ({unit})")
    columns[0][1].set_xlim(0, t_max * 1.01 if t_max > 0 else 1.0)
    # the latency axes are shared across runs: fit the slowest run's latencies, not the first's
    lat_max = (
        max(
            (v for rec in runs for r in rec.requests for v in (r["ttft"], r["e2e_latency"]) if v is not None),
            default=0.0,
        )
        * scale
    )
    columns[0][4].set_xlim(0, lat_max * 1.03 if lat_max > 0 else 1.0)
    if len(runs) > 1:
        kv_top = max(max(r.num_pages for r in runs), 1)
        columns[0][2].set_ylim(0, kv_top * HEADROOM)
        q_top = max((max(s["num_running"], s["num_waiting"]) for r in runs for s in r.step_stats), default=1)
        columns[0][3].set_ylim(0, q_top * HEADROOM + 0.5)
    fig.suptitle("minisched request lifecycle", fontsize=15, fontweight="bold", y=0.985)
    handles = _legend_handles()
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=len(handles) if len(runs) > 1 else 5,
        fontsize=9,
        frameon=False,
        bbox_to_anchor=(0.5, 0.968),
    )
    return fig


FORMATS = ("png", "svg", "pdf")


def output_format(path: str | Path) -> str:
    """The picture format named by the file's extension; ValueError for any other."""
    ext = Path(path).suffix.lower().lstrip(".")
    if ext not in FORMATS:
        raise ValueError(f"{path}: unknown picture format {ext or '(no extension)'!r}; use .png, .svg or .pdf")
    return ext


def render_report(runs: list[RunRecord] | RunRecord, out: str | Path, html: str | Path | None = None) -> None:
    """Write the lifecycle picture (PNG of size `figure_size(len(runs))`, or SVG / PDF, by `out`'s
    extension) and, if `html` is given, a self-contained HTML page with a PNG and summary tables."""
    runs = [runs] if isinstance(runs, RunRecord) else list(runs)
    fmt = output_format(out)
    fig = render_figure(runs)
    try:
        formats = [fmt] + (["png"] if html is not None and fmt != "png" else [])
        data = {}
        for f in formats:
            buf = io.BytesIO()
            fig.savefig(buf, format=f, dpi=DPI)
            data[f] = buf.getvalue()
    finally:
        plt.close(fig)
    Path(out).write_bytes(data[fmt])
    if html is not None:
        Path(html).write_text(html_page(runs, data["png"]))


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _table(title: str, runs: list[RunRecord], rows: list[dict]) -> str:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    if not keys:
        return ""
    esc = html_lib.escape
    head = "".join(f"<th>{esc(r.name)}</th>" for r in runs)
    body = "".join(
        f"<tr><td>{esc(k)}</td>" + "".join(f"<td>{esc(_fmt(r.get(k)))}</td>" for r in rows) + "</tr>" for k in keys
    )
    return f"<h2>{esc(title)}</h2>\n<table><tr><th></th>{head}</tr>{body}</table>\n"


def _stories(run: RunRecord) -> str:
    """One row per request, in the picture's order (arrival): click it for its story (observe/explain.py)."""
    texts = story_texts(run)
    if not texts:
        return ""
    esc = html_lib.escape
    rows = "".join(
        f"<details><summary>{esc(rid)}</summary><pre>{esc(text)}</pre></details>" for rid, text in texts.items()
    )
    return f"<h2>{esc(run.name)}: why each request waited (click a request)</h2>\n{rows}\n"


def html_page(runs: list[RunRecord], png: bytes) -> str:
    img = base64.b64encode(png).decode("ascii")
    names = ", ".join(r.name for r in runs)
    tables = (
        _table("Summary (from the recorded events)", runs, [derived_summary(r) for r in runs])
        + _table("Benchmark summary", runs, [_flatten(r.summary) for r in runs])
        + _table("Configuration", runs, [_flatten(r.config) for r in runs])
    )
    tables += "".join(_stories(r) for r in runs)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>minisched report: {html_lib.escape(names)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: 3px 10px; text-align: right; }}
td:first-child {{ text-align: left; }}
pre {{ margin: 0.3em 0 0.8em 1.5em; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>minisched request lifecycle: {html_lib.escape(names)}</h1>
<img alt="lifecycle report" src="data:image/png;base64,{img}">
{tables}<p>Open the Chrome trace (<code>minisched report RUN.json --trace trace.json</code>) in
<a href="https://ui.perfetto.dev">ui.perfetto.dev</a> or chrome://tracing for per-step detail.</p>
</body></html>
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="minisched report", description="Render the request-lifecycle report of a recorded run file."
    )
    p.add_argument("run_file", help="run JSON written by the serving benchmark ({'version': 1, 'runs': [...]})")
    p.add_argument(
        "-o", "--output", default="report.png", help="picture to write: .png, .svg or .pdf (default: report.png)"
    )
    p.add_argument("--html", default=None, help="also write a self-contained HTML page")
    p.add_argument("--trace", default=None, help="also write a Chrome/Perfetto trace JSON")
    args = p.parse_args(argv)
    try:
        output_format(args.output)
    except ValueError as e:
        p.error(str(e))
    for flag, path in (("-o", args.output), ("--html", args.html), ("--trace", args.trace)):
        problem = unwritable(path)
        if problem:
            p.error(f"{flag} {path}: {problem}")
    try:
        runs = load_runs(args.run_file)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if not runs:
        p.error(f"{args.run_file}: no runs")
    render_report(runs, args.output, args.html)
    written = [args.output] + [x for x in (args.html,) if x]
    if args.trace:
        from minisched.observe.trace import write_chrome_trace

        write_chrome_trace(args.trace, runs)
        written.append(args.trace)
    print("wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
