"""`minisched serve --record PATH`: an engine's scheduler records -- journal, events, step stats -- as a
series of run files (run_record.py's format), rotating and bounded.

Names: PATH `runs/serve.json` gives `runs/serve.r0.20261206T003712.345Z.p4242.0000.json`: the replica,
the series (one engine process: its start, UTC, and its pid) and the segment. Every engine process --
each `--dp` replica, each restart -- starts a series of its own, so no file is ever overwritten.

Bounds: a segment ends when the next step's records would take the file past `max_bytes` (one step that
alone is larger gets a file of its own); then the replica keeps its `keep` newest files, over all its
series (an earlier server's too), and deletes the older ones.

Writing: the engine loop (serve/engine_loop.py) hands over what is new every `interval` seconds and
before each drain of the scheduler's records, and goes on; this module's thread turns the records into
JSON lines and rewrites the current segment (a temporary file, then a rename: a reader never sees half a
file, and an engine that is killed leaves its last write). Memory: the current segment's lines, and its
events as dicts (each request's metrics are recomputed from them).

A segment after the first starts mid-run: the scheduler's earlier inputs are not in its journal, so it
cannot be replayed alone. `join_series` joins the files of one series, from segment 0 on, into one run
for `minisched replay` (exact and what-if); once rotation has deleted segment 0, a series can only be
explained, not replayed. `minisched explain` reads any one file: `carried` holds the requests live at the
segment's start (arrival step and time, prompt length, waiting or not) and `client_ids` maps each
client's X-Request-Id to the engine's request ids.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from minisched.base.flags import byte_size, flag
from minisched.observe.run_record import (
    RunRecord,
    dump,
    file_text,
    plain,
    relative,
    request_metrics,
    run_text,
)
from minisched.sched.snapshot import Records

log = logging.getLogger("minisched.serve")
DEFAULT_MAX_BYTES = 16 * 2**20  # one segment file, at most (16 MiB: ~10k requests' decisions)
DEFAULT_KEEP = 8  # files kept per replica
DEFAULT_INTERVAL = 10.0  # seconds between writes: the files lag the engine by about this much
MIN_MAX_BYTES = 64 * 2**10
HEAD_BYTES = 1024  # a file's head (name, summary, its place in the series) and its punctuation, at most
REQUEST_BYTES = 512  # one request's metrics line, at most, besides its id
ENDED = ("finished", "aborted")
STAMP = r"\d{8}T\d{6}\.\d{3}Z"


@dataclass(frozen=True)
class RecordOptions:
    """Where and how much `serve --record` writes (the base path's folder must exist; no path: no recording).
    The flags: `minisched serve --record PATH --record-max-bytes ...` (cli/serve.py's ServeConfig)."""

    path: Optional[str] = flag(
        None,
        "write each engine process's scheduler journal and events to PATH's series of run files: "
        "runs/serve.json -> runs/serve.r<replica>.<start>.p<pid>.<segment>.json",
        name="--record",
        metavar="PATH",
        type=str,
    )
    max_bytes: int = flag(
        DEFAULT_MAX_BYTES, f"bytes of one record file ({byte_size(DEFAULT_MAX_BYTES)}); past them the next file starts"
    )
    keep: int = flag(DEFAULT_KEEP, "record files kept per replica, the oldest deleted")
    interval: float = flag(
        DEFAULT_INTERVAL, "seconds between writes of what is new (the files lag the engine by about this much)"
    )

    def __post_init__(self) -> None:
        if self.path == "":
            raise ValueError("record: the path is empty")
        if self.max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"record_max_bytes must be >= {MIN_MAX_BYTES}, got {self.max_bytes}")
        if self.keep < 1:
            raise ValueError(f"record_keep must be >= 1, got {self.keep}")
        if not self.interval > 0:
            raise ValueError(f"record_interval must be > 0, got {self.interval}")

    @property
    def base(self) -> tuple[Path, str, str]:
        """(folder, stem, suffix) of the base path; no suffix: .json."""
        if self.path is None:
            raise ValueError("record: no path (not recording)")
        p = Path(self.path)
        return p.parent, p.stem if p.suffix else p.name, p.suffix or ".json"

    def segment_path(self, replica: int, series: str, segment: int) -> Path:
        folder, stem, suffix = self.base
        return folder / f"{stem}.r{replica}.{series}.{segment:04d}{suffix}"

    def replica_files(self, replica: int) -> list[Path]:
        """Replica `replica`'s files of this base path, any series, oldest first."""
        folder, stem, suffix = self.base
        pattern = re.compile(re.escape(f"{stem}.r{replica}.") + rf"({STAMP})\.p(\d+)\.(\d+)" + re.escape(suffix) + "$")
        found = []
        for p in folder.glob(f"{glob_escape(stem)}.r{replica}.*{glob_escape(suffix)}"):
            m = pattern.match(p.name)
            if m:
                found.append(((m.group(1), int(m.group(3)), int(m.group(2))), p))
        return [p for _, p in sorted(found)]


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def series_name(wall: float, pid: int) -> str:
    """An engine process's series: its start (UTC, milliseconds) and pid; names sort by start."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(wall)) + f".{int(wall % 1 * 1000):03d}Z.p{pid}"


@dataclass
class Segment:
    """The file being written: its items as JSON lines, its events as dicts (for the request metrics)."""

    number: int
    path: Path
    lines: dict[str, list[str]] = field(
        default_factory=lambda: {"events": [], "step_stats": [], "journal": [], "carried": []}
    )
    events: list[dict] = field(default_factory=list)
    client_ids: dict[str, list[str]] = field(default_factory=dict)
    rids: set[str] = field(default_factory=set)
    size: int = 0  # bytes of its lines, the request lines' bound and the client ids
    first_step: int | None = None
    last_step: int | None = None
    written: bool = False

    @property
    def empty(self) -> bool:
        return not (self.lines["events"] or self.lines["step_stats"] or self.lines["journal"])

    def add_client(self, client_id: str, rids: list[str]) -> None:
        if client_id not in self.client_ids:
            self.size += len(dump(client_id)) + 4
        mine = self.client_ids.setdefault(client_id, [])
        for rid in rids:
            mine.append(rid)
            self.size += len(dump(rid)) + 2


class SeriesRecorder:
    """serve/recorder.py's Recorder for one engine process: its series of files under `options`.

    `calls`, `write` and `close` are called on the engine thread and only queue; the writing is this
    object's own thread's."""

    def __init__(self, options: RecordOptions, replica: int = 0) -> None:
        self.options, self.replica, self.interval = options, replica, options.interval
        self.t0 = time.monotonic()  # the series' clock: every time in its files is relative to it
        self.started = time.time()
        self.series = series_name(self.started, os.getpid())
        # a second recorder of this process within the millisecond (after the first wrote) takes the next one
        while options.segment_path(replica, self.series, 0).exists():
            time.sleep(0.001)
            self.started = time.time()
            self.series = series_name(self.started, os.getpid())
        self.segment = Segment(0, options.segment_path(replica, self.series, 0))
        self.files_written = 0
        self.errors = 0
        self.cpu_s = 0.0  # the writer thread's CPU time so far (what recording costs the process)
        self.bytes_taken = 0  # JSON bytes of the records handed over so far
        self._scheduler: dict = {}  # the init entry's config (num_pages, page_size)
        self._head = HEAD_BYTES  # bytes of a file's head: HEAD_BYTES and the scheduler's config
        self._step = 0  # the last build's step: the step a journal entry belongs to
        self._live: dict[str, dict] = {}  # rid -> its carried entry, until it ends
        self._client_of: dict[str, str] = {}  # rid -> client id, until it ends
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"minisched-record-{replica}", daemon=True)
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------------------
    def calls(self, client_id: str, rids: list[str]) -> None:
        self._inbox.put(("calls", client_id, list(rids)))

    def write(self, records: Records) -> None:
        self._inbox.put(("records", records))

    def close(self, timeout: float = 60.0) -> None:
        self._inbox.put(("close",))
        self._thread.join(timeout)

    # -- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            msg = self._inbox.get()
            started = time.thread_time()
            try:
                if msg[0] == "calls":
                    _, client_id, rids = msg
                    for rid in rids:
                        self._client_of[rid] = client_id
                    self.segment.add_client(client_id, rids)
                elif msg[0] == "records":
                    self._take(msg[1])
                    self._save()
                else:
                    self._save()
                    return
            except Exception as exc:  # a full disk must not take the engine down: say so, go on
                self.errors += 1
                if self.errors == 1 or self.errors % 100 == 0:
                    log.error("serve --record: %s (%d error(s) so far)", f"{type(exc).__name__}: {exc}", self.errors)
            finally:
                self.cpu_s += time.thread_time() - started

    def _take(self, records: Records) -> None:
        """The records, a step at a time: a step that would take the file past its bound starts the next one."""
        steps: dict[int, dict[str, list[dict]]] = {}

        def part(step: int, kind: str) -> list[dict]:
            return steps.setdefault(step, {"events": [], "step_stats": [], "journal": []})[kind]

        for e in records.journal:
            if e.get("op") == "init":
                self._scheduler = dict(e.get("config", {}))
                self._head = HEAD_BYTES + len(dump(self._scheduler))
            elif e.get("op") == "build":
                self._step = int(e["step"])
            part(self._step, "journal").append(relative(e, self.t0))
        for ev in records.events:
            part(ev.step, "events").append(plain(ev, self.t0))
        for st in records.step_stats:
            part(st.step, "step_stats").append(plain(st, self.t0))
        for step in sorted(steps):
            self._add_step(step, steps[step])

    def _add_step(self, step: int, items: dict[str, list[dict]]) -> None:
        lines = {k: [dump(x) for x in v] for k, v in items.items()}
        self.bytes_taken += sum(len(x) + 4 for v in lines.values() for x in v)
        new_rids = {e["rid"] for e in items["events"]} - self.segment.rids
        size = sum(len(x) + 4 for v in lines.values() for x in v) + sum(REQUEST_BYTES + len(r) for r in new_rids)
        if not self.segment.empty and self._head + self.segment.size + size > self.options.max_bytes:
            self._rotate()
            new_rids = {e["rid"] for e in items["events"]}
            size = sum(len(x) + 4 for v in lines.values() for x in v) + sum(REQUEST_BYTES + len(r) for r in new_rids)
        seg = self.segment
        for k, v in lines.items():
            seg.lines[k] += v
        seg.events += items["events"]
        seg.rids |= new_rids
        seg.size += size
        seg.first_step = step if seg.first_step is None else seg.first_step
        seg.last_step = step
        self._follow(step, items)

    def _follow(self, step: int, items: dict[str, list[dict]]) -> None:
        """Which requests are live, and waiting or not (what the next segment carries)."""
        for e in items["journal"]:
            op = e.get("op")
            if op == "add":
                self._live[e["rid"]] = {
                    "op": "add",
                    "rid": e["rid"],
                    "prompt_len": len(e.get("prompt", ())),
                    "t": e.get("t", 0.0),
                    "step": step,
                    "waiting": True,
                }
            elif op == "build":
                why = e.get("why", {})
                for a in why.get("admitted", ()):
                    if a[0] in self._live:
                        self._live[a[0]]["waiting"] = False
                for r in why.get("retracted", ()):
                    if r[0] in self._live:
                        self._live[r[0]]["waiting"] = True
        for ev in items["events"]:
            if ev["dst"] in ENDED:
                self._live.pop(ev["rid"], None)
                self._client_of.pop(ev["rid"], None)

    def _rotate(self) -> None:
        """Close the current segment and start the next: it carries the live requests and their client ids."""
        self._save()
        number = self.segment.number + 1
        seg = Segment(number, self.options.segment_path(self.replica, self.series, number))
        for entry in self._live.values():
            line = dump(entry)
            seg.lines["carried"].append(line)
            seg.size += len(line) + 4
        by_client: dict[str, list[str]] = {}
        for rid, client in self._client_of.items():
            by_client.setdefault(client, []).append(rid)
        for client, rids in by_client.items():
            seg.add_client(client, rids)
        self.segment = seg

    def _save(self) -> None:
        seg = self.segment
        if seg.empty and not seg.written:
            return
        cfg = self._scheduler
        record = {
            "series": self.series,
            "replica": self.replica,
            "segment": seg.number,
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "first_step": seg.first_step,
            "last_step": seg.last_step,
        }
        head = {
            "name": dump(f"serve r{self.replica} {self.series} #{seg.number}"),
            "config": dump({"record": record, "scheduler": cfg}),
            "summary": dump({}),
            "num_pages": dump(int(cfg.get("num_pages") or 0)),
            "page_size": dump(int(cfg.get("page_size") or 0)),
            "client_ids": dump(seg.client_ids),
        }
        lists = {**seg.lines, "requests": [dump(m) for m in request_metrics(seg.events)]}
        text = file_text([run_text(head, lists)])
        tmp = seg.path.with_name(seg.path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, seg.path)
        if not seg.written:
            seg.written = True
            self.files_written += 1
            self._prune()

    def _prune(self) -> None:
        """Keep the replica's `keep` newest files (over all its series)."""
        files = self.options.replica_files(self.replica)
        for old in files[: max(0, len(files) - self.options.keep)]:
            try:
                old.unlink()
            except FileNotFoundError:  # another process pruned it first
                pass


# -- reading a series ----------------------------------------------------------------------------
def record_info(run: RunRecord) -> dict | None:
    """A `serve --record` file's place in its series (series, replica, segment, ...), or None."""
    info = run.config.get("record")
    return info if isinstance(info, dict) and "series" in info and "segment" in info else None


def starts_mid_run(run: RunRecord) -> bool:
    return bool(run.journal) and run.journal[0].get("op") != "init"


def join_series(runs: list[tuple[str, RunRecord]]) -> RunRecord:
    """The files of one series, from segment 0 on, as one run (ValueError naming what is wrong)."""
    infos = []
    for path, run in runs:
        info = record_info(run)
        if info is None:
            raise ValueError(f"{path}: not a file of a `serve --record` series (replay reads one such run at a time)")
        infos.append((int(info["segment"]), f"r{info.get('replica', 0)} {info['series']}", path, run))
    names = sorted({name for _, name, _, _ in infos})
    if len(names) > 1:
        raise ValueError(f"files of {len(names)} series ({', '.join(names)}): replay one engine's series at a time")
    infos.sort(key=lambda x: x[0])
    numbers = [n for n, _, _, _ in infos]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"series {names[0]}: a segment was given twice")
    missing = sorted(set(range(numbers[-1] + 1)) - set(numbers))
    if missing:
        why = " (rotated away: --record-keep)" if missing[0] == 0 else ""
        raise ValueError(f"series {names[0]}: segment {missing[0]} is missing{why}; replay needs every segment from 0")
    first = infos[0][3]
    joined = RunRecord(
        name=f"serve {names[0]}",
        config={**first.config, "record": {**first.config["record"], "segments": len(infos)}},
        num_pages=first.num_pages,
        page_size=first.page_size,
    )
    for _, _, _, run in infos:
        joined.events += run.events
        joined.step_stats += run.step_stats
        joined.journal += run.journal
        for client, rids in run.client_ids.items():
            have = joined.client_ids.setdefault(client, [])
            have += [r for r in rids if r not in have]
    joined.requests = request_metrics(joined.events)
    return joined
