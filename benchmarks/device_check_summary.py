"""device_check.sh's last step: summary.txt (<= 8,000 characters, most important first) and results.json.

    python benchmarks/device_check_summary.py WORK OUTDIR [--budget S] [--seconds S] [--limit 8000]

Reads what the stages left in WORK (stages.tsv, env.txt, junit_*.xml and pytest*.log, sanitize_*.log,
bench_all.json from `bench_kernels_gpu.py --merge`, e2e.json, cuda_graph.json, res_usage.txt) and writes
OUTDIR/summary.txt and OUTDIR/results.json. Sections, in order: the header (time, budget, commit, GPU,
versions), the stage table, the tests (counts, then every failing test id), one row per target (goal,
value, the best torch path's figure from the same run), the sanitizers' verdicts, then the kernel table,
registers / stack / local memory, the end-to-end numbers. Sections are added in that order while they
fit; the first that does not is cut at a line and the rest are left to the tarball.
Standard library only (it runs even where torch does not import).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

# a report's first line ("========= Invalid __global__ read ...", "========= Error: Race reported ...");
# not the tool's own lines, nor the indented details under a report
SAN_ERROR = re.compile(
    r"^========= (?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER|Saved host backtrace|"
    r"Target application returned|This application|\s)(.*)"
)
SAN_AT = re.compile(r"^=========\s+at (?:0x[0-9a-f]+ in )?(.+)")


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stages(work: str) -> list[dict]:
    rows = []
    for line in read(os.path.join(work, "stages.tsv")).splitlines()[1:]:
        parts = line.split("\t")
        if len(parts) >= 3:
            rows.append(
                {
                    "stage": parts[0],
                    "status": parts[1],
                    "seconds": int(parts[2] or 0),
                    "limit": parts[3] if len(parts) > 3 else "",
                }
            )
    return rows


STAGE_LOG = {
    "build": "build.log",
    "res_usage": "res_usage.txt",
    "bench_wgmma": "bench_wgmma.log",
    "sanitize_memcheck": "sanitize_memcheck.log",
    "sanitize_racecheck": "sanitize_racecheck.log",
    "bench": "bench.log",
    "e2e": "e2e.log",
    "cuda_graph": "cuda_graph.log",
    "flex": "bench_flex.log",
}


def why(work: str, stage: str) -> str | None:
    """The line of a failed stage's log that says why: its last Python exception line, else its first
    compiler-style error, else its last line (the test stages have their own section)."""
    lines = [
        ln.strip()
        for ln in read(os.path.join(work, STAGE_LOG.get(stage, "-"))).splitlines()
        if ln.strip() and not ln.startswith("== [")
    ]
    exc = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b", ln)]
    err = [ln for ln in lines if re.search(r"\berror\b", ln, re.I)]
    pick = exc[-1] if exc else err[0] if err else lines[-1] if lines else None
    return pick[:150] if pick else None


def env(work: str) -> dict:
    out = {}
    for line in read(os.path.join(work, "env.txt")).splitlines():
        key, sep, val = line.partition(": ")
        if sep and key and " " not in key:
            out.setdefault(key, val.strip())
    return out


def test_id(case: ET.Element) -> str:
    cls, name = case.get("classname", ""), case.get("name", "")
    parts = cls.split(".")
    # "tests.ops.test_x" -> tests/ops/test_x.py; "tests.ops.test_x.TestClass" keeps the class
    for i in range(len(parts), 0, -1):
        if parts[i - 1].startswith("test_"):
            return "/".join(parts[:i]) + ".py::" + "::".join(parts[i:] + [name])
    return f"{cls}::{name}" if cls else name


def pytest_result(work: str, junit: str, log: str) -> dict:
    """Counts and failing ids from the junit file (pytest writes it on SIGINT too), the last line of the log."""
    res = {"junit": os.path.exists(os.path.join(work, junit)), "failed": [], "counts": {}}
    text = read(os.path.join(work, log))
    finals = [
        ln.strip("= ")
        for ln in text.splitlines()
        if re.match(
            r"^=*\s*(\d+ (passed|failed|errors?|skipped|deselected|tests? collected)|no tests ran)"
            r".* in [\d.]+s\b",
            ln,
        )
    ]
    res["final_line"] = finals[-1] if finals else None
    res["interrupted"] = "KeyboardInterrupt" in text
    if res["junit"]:
        try:
            root = ET.parse(os.path.join(work, junit)).getroot()
        except ET.ParseError as exc:
            res["junit_error"] = str(exc)
            return res
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        for key in ("tests", "failures", "errors", "skipped"):
            res["counts"][key] = sum(int(s.get(key, 0)) for s in suites)
        for case in root.iter("testcase"):
            for kind in ("failure", "error"):
                el = case.find(kind)
                if el is not None:
                    msg = (el.get("message") or el.text or "").strip().splitlines()
                    res["failed"].append({"id": test_id(case), "kind": kind, "message": msg[0][:160] if msg else ""})
    return res


def sanitizer(work: str, tool: str) -> dict | None:
    text = read(os.path.join(work, f"sanitize_{tool}.log"))
    if not text:
        return None
    summary = [
        ln.removeprefix("========= ") for ln in text.splitlines() if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln
    ]
    cases, pending, per_case = [], [], {}
    for line in text.splitlines():
        m = SAN_ERROR.match(line)
        if m and not line.startswith("=========     "):
            pending.append([m.group(1).strip(), None])
            continue
        at = SAN_AT.match(line)
        if at and pending and pending[-1][1] is None:
            pending[-1][1] = at.group(1)[:90]
            continue
        cm = re.match(r"^case (\S+): (.*)", line)
        if cm:
            cases.append({"case": cm.group(1), "result": cm.group(2)})
            if pending:
                per_case[cm.group(1)] = pending
            pending = []
    if pending:
        per_case["(after the last case)"] = pending
    return {
        "summary": summary[-1] if summary else None,
        "cases": cases,
        "reports": {k: [{"what": w, "at": a} for w, a in v] for k, v in per_case.items()},
    }


def kernel_name(mangled: str) -> str:
    """_ZN9minisched4cuda..22paged_attention_kernelI13__nv_bfloat16Li128ELi1ELi4ELi1EEEv... ->
    paged_attention_kernel<bf16,128,1,4,1> (the template arguments: dtype, head_dim, warps, fragments)."""
    names, i = [], 0  # the length-prefixed identifiers of the Itanium mangling, in order
    while i < len(mangled):
        m = re.match(r"\d+", mangled[i:])
        if m and not (i and mangled[i - 1] in "SL"):  # not S0_ / Li128E (substitutions, literals)
            n, start = int(m.group()), i + len(m.group())
            names.append((mangled[start : start + n], start + n))
            i = start + n
        else:
            i += 1
    kern = next(((nm, end) for nm, end in reversed(names) if nm.endswith("kernel")), None)
    if not kern:
        return mangled[:80]
    rest = mangled[kern[1] :].split("Ev", 1)[0]
    args = [
        {"6__half": "fp16", "13__nv_bfloat16": "bf16"}.get(a, a[2:-1])
        for a in re.findall(r"6__half|13__nv_bfloat16|Li\d+E", rest)
    ]
    return kern[0] + (f"<{','.join(args)}>" if args else "")


def res_usage(work: str) -> list[str]:
    rows, name = [], None
    for line in read(os.path.join(work, "res_usage.txt")).splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        r = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", line)
        if r and name:
            rows.append(f"{r.group(1):>4} {r.group(2):>5} {r.group(4):>5}  {kernel_name(name)}")
            name = None
    return rows


def e2e_targets(work: str) -> tuple[list[dict], dict]:
    """Rows for the end-to-end runs: tok/s with and without CUDA graphs, and the short serving bench."""
    rows, raw = [], {}
    cg = load_json(os.path.join(work, "cuda_graph.json"))
    if cg:
        raw["cuda_graph"] = cg
        for c in cg.get("cases", []):
            ok = c.get("ratio", 0) > 1 and c.get("first_tokens_equal")
            rows.append(
                {
                    "target": f"e2e decode B={c['batch']}: graphs > eager",
                    "met": bool(ok),
                    "goal": "graphs faster, tokens equal",
                    "value": f"eager {c['tok_s_off']:.0f}, graphs {c['tok_s_on']:.0f} tok/s "
                    f"({c['ratio']:.2f}x, first tokens equal: {c['first_tokens_equal']})",
                    "torch": "n/a",
                }
            )
    e2e = load_json(os.path.join(work, "e2e.json"))
    runs = (e2e or {}).get("runs") or []
    if runs:
        s = runs[0].get("summary") or {}
        raw["e2e"] = s
        tps, ttft = s.get("output_tok_s"), (s.get("ttft_s") or {}).get("p50")
        value = "n/a" if tps is None else f"{tps:.0f} output tok/s, {s.get('completed')}/{s.get('num_requests')} done"
        if ttft is not None:
            value += f", TTFT p50 {1e3 * ttft:.0f} ms"
        rows.append(
            {"target": "e2e minisched bench (CUDA graphs on)", "met": None, "goal": "-", "value": value, "torch": "n/a"}
        )
    return rows, raw


def target_lines(targets: list[dict]) -> list[str]:
    lines = [f"{'met':<8} {'target':<38} {'goal':<26} {'value':<44} best torch path (same run)"]
    for t in targets:
        met = {True: "MET", False: "NOT MET", None: "n/a"}[t.get("met")]
        lines.append(f"{met:<8} {t['target']:<38} {t['goal']:<26} {t['value']:<44} {t.get('torch', 'n/a')}")
    return lines


def kernel_lines(results: list[dict]) -> list[str]:
    lines = [f"{'case':<24}{'impl':<26}{'ms':>10}{'GB/s':>9}{'TFLOP/s':>9}"]
    for r in results:
        if r.get("ms"):
            gb = f"{r['GB/s']:.0f}" if r.get("GB/s") else ""
            tf = f"{r['TFLOP/s']:.0f}" if r.get("TFLOP/s") else ""
            lines.append(f"{r['case']:<24}{r['impl']:<26}{r['ms']:>10.4f}{gb:>9}{tf:>9}")
        else:
            lines.append(f"{r['case']:<24}{r['impl']:<26}{'failed':>10}  {(r.get('error') or '')[:70]}")
    return lines


def compose(sections: list[tuple[str, list[str]]], limit: int) -> str:
    """Sections in order while they fit in `limit` characters (keeping room for a closing note); the first
    that does not is cut at a line, and the note says which sections are left to the tarball."""
    reserve = 160
    out, used = [], 0
    for i, (title, lines) in enumerate(sections):
        block = ([title] if title else []) + lines + [""]
        text = "\n".join(block) + "\n"
        last = i == len(sections) - 1
        if used + len(text) <= limit - (0 if last else reserve):
            out.append(text)
            used += len(text)
            continue
        rest = [t.removeprefix("-- ").split(" ")[0] for t, _ in sections[i:] if t]
        note = f"[cut at {limit} characters; the rest ({', '.join(rest)}) is in device_check.tar.gz]"[: reserve - 1]
        room = limit - used - len(note) - 1
        kept = []
        for ln in block:
            if room < len(ln) + 1:
                break
            kept.append(ln)
            room -= len(ln) + 1
        out.append("".join(ln + "\n" for ln in kept) + note + "\n")
        break
    return "".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("out")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--limit", type=int, default=8000, help="summary.txt's size in characters at most")
    args = ap.parse_args(argv)
    w = args.work
    info, st = env(w), stages(w)
    tests = {
        "tests": pytest_result(w, "junit_tests.xml", "pytest.log"),
        "tests_wgmma": pytest_result(w, "junit_tests_wgmma.xml", "pytest_wgmma.log"),
    }
    san = {t: sanitizer(w, t) for t in ("memcheck", "racecheck")}
    bench = load_json(os.path.join(w, "bench_all.json")) or {}
    e2e_rows, e2e_raw = e2e_targets(w)
    targets = list(bench.get("targets", [])) + e2e_rows
    meta = bench.get("meta", {})

    head = [
        f"commit {info.get('commit', 'n/a')} | {info.get('date', '')} | gpu: {info.get('gpu', 'n/a')}",
        f"torch {info.get('torch', 'n/a')} | triton {info.get('triton', 'n/a').removeprefix('yes ')}"
        f" | nvcc {info.get('nvcc', 'n/a')}"
        f" | copy {meta.get('copy_GBps', 0):.0f} GB/s, bf16 mm {meta.get('matmul_TFLOPs', 0):.0f} TFLOP/s",
        f"native extension: {info.get('native', 'n/a')}",
    ]
    stage_lines = [f"{'stage':<20}{'status':<28}{'s':>5}{'limit':>7}"]
    stage_lines += [f"{r['stage']:<20}{r['status']:<28}{r['seconds']:>5}{r['limit']:>7}" for r in st]
    for r in st:
        if not r["status"].startswith(("ok", "skipped")) and why(w, r["stage"]):
            stage_lines.append(f"  {r['stage']}: {why(w, r['stage'])}")
    test_lines = []
    for name, t in tests.items():
        c = t["counts"]
        if not t["junit"] and not t["final_line"]:
            test_lines.append(f"{name}: no result (stage skipped, or no junit file and no summary line)")
            continue
        counts = (
            f"{c.get('tests', 0)} run, {c.get('failures', 0)} failed, {c.get('errors', 0)} errors, "
            f"{c.get('skipped', 0)} skipped"
            if c
            else "no junit file"
        )
        test_lines.append(f"{name}: {counts} | {t['final_line'] or ''}{' | INTERRUPTED' if t['interrupted'] else ''}")
        shown = t["failed"][:25]
        test_lines += [f"  {f['kind'].upper()} {f['id']}  {f['message'][:110]}" for f in shown]
        if len(t["failed"]) > len(shown):
            test_lines.append(f"  ... and {len(t['failed']) - len(shown)} more (junit in the tarball)")
    san_lines = []
    for tool, s in san.items():
        if s is None:
            san_lines.append(f"{tool}: not run")
            continue
        bad = [c for c in s["cases"] if not c["result"].startswith(("ok", "skipped"))]
        san_lines.append(
            f"{tool}: {s['summary'] or 'no summary line (see the log)'} | {len(s['cases'])} cases ran, "
            f"{len(bad)} raised" + (f" (first: {bad[0]['case']}: {bad[0]['result'][:70]})" if bad else "")
        )
        for case, reps in list(s["reports"].items())[:8]:
            first = reps[0]
            san_lines.append(
                f"  {case}: {len(reps)} reports; first: {first['what'][:90]}"
                + (f" at {first['at']}" if first["at"] else "")
            )
    e2e_lines = []
    for name in ("e2e.log", "cuda_graph.log"):
        tail = [ln for ln in read(os.path.join(w, name)).splitlines() if ln.strip()][-4:]
        if tail:
            e2e_lines += [f"[{name}]"] + [f"  {ln[:150]}" for ln in tail]
    total = f"{args.seconds}s" + (f" of a {args.budget}s budget" if args.budget else "")
    sections = [
        (f"================ device_check summary: {total} ================", head),
        ("-- stages", stage_lines),
        ("-- tests (failing ids first; full logs and junit in device_check.tar.gz)", test_lines),
        (
            "-- targets (native kernels unless named; torch: the fastest torch path in the same run)",
            target_lines(targets) if targets else ["(no bench_all.json: see bench*.log in the tarball)"],
        ),
        ("-- compute-sanitizer (one tiny case per kernel configuration)", san_lines),
        ("-- kernels (median)", kernel_lines(bench.get("results", []))),
        (
            "-- cuobjdump -res-usage: REG STACK LOCAL kernel<dtype,head_dim,row warps,kv warps,row fragments>",
            res_usage(w) or ["(none)"],
        ),
        ("-- end to end (tails)", e2e_lines or ["(none)"]),
    ]
    summary = compose(sections, args.limit)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(summary)
    results = {
        "env": info,
        "seconds": args.seconds,
        "budget": args.budget,
        "stages": st,
        "tests": tests,
        "sanitizer": san,
        "targets": targets,
        "kernels": bench.get("results", []),
        "kernel_meta": meta,
        "e2e": e2e_raw,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"summary.txt: {len(summary)} characters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
