"""`minisched generate`: prompts from the command line or a JSON-lines file, printed or streamed.

Every prompt has a label for messages: its JSONL `id` when it has one, else `prompt N`
(0-based, in input order). A file is checked whole before the model loads: a line with a
wrong field type is an error naming the file and line (exit 2). A request that fails at run
time is reported as `minisched: request <label>: <reason>` on stderr and the exit status is 1;
the other requests still run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from minisched.cli.common import SAMPLING_FIELDS, CLIError, check_output_path, engine_config, make_engine, sampling_from
from minisched.cli.status import StatusLine
from minisched.sched.sampling_params import SamplingParams

LENGTH_REASONS = ("max_new_tokens", "length")


@dataclass
class PromptItem:
    index: int
    prompt: object  # text, token ids or chat messages
    sampling: SamplingParams
    id: object = None  # the JSONL "id", echoed in --json output
    where: str = ""  # "file:line" for file prompts
    overrides: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"id={self.id!r}" if self.id is not None else f"prompt {self.index}"


def _check_line(obj: dict, where: str) -> tuple[object, dict]:
    """The prompt and sampling overrides of one JSONL object; CLIError naming file:line."""
    unknown = set(obj) - {"prompt", "messages", "id"} - set(SAMPLING_FIELDS)
    if unknown:
        raise CLIError(f"{where}: unknown fields {sorted(unknown)}")
    if "prompt" in obj and "messages" in obj:
        raise CLIError(f"{where}: give 'prompt' or 'messages', not both")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise CLIError(f'{where}: \'messages\' must be a list of {{"role": str, "content": str}} objects')
        prompt = msgs
    else:
        prompt = obj["prompt"]
        if not (
            isinstance(prompt, str)
            or (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        ):
            raise CLIError(f"{where}: 'prompt' must be a string or a list of token ids, got {prompt!r:.60}")
    if "id" in obj and not isinstance(obj["id"], (str, int)):
        raise CLIError(f"{where}: 'id' must be a string or an int")
    overrides = {}
    for k in SAMPLING_FIELDS:
        if k not in obj:
            continue
        v = obj[k]
        if k == "stop":
            if isinstance(v, str):
                v = (v,)
            elif isinstance(v, list) and all(isinstance(s, str) for s in v):
                v = tuple(v)
            else:
                raise CLIError(f"{where}: 'stop' must be a string or a list of strings, got {v!r}")
        elif k == "stop_token_ids":
            if not isinstance(v, list):
                raise CLIError(f"{where}: 'stop_token_ids' must be a list of token ids, got {v!r}")
            v = tuple(v)
        elif k == "logit_bias":  # JSON keys are strings: {"123": -5.0}
            if not isinstance(v, dict) or not all(isinstance(t, str) and t.isdigit() for t in v):
                raise CLIError(f"{where}: 'logit_bias' must map token ids to biases, got {v!r:.60}")
            v = {int(t): b for t, b in v.items()}
        overrides[k] = v
    return prompt, overrides


def read_prompts(args) -> list[PromptItem]:
    items: list[PromptItem] = []
    for text in args.prompts:
        items.append(PromptItem(len(items), text, sampling_from(args)))
    if args.file:
        name = "<stdin>" if args.file == "-" else args.file
        try:
            f = sys.stdin if args.file == "-" else open(args.file)
        except OSError as exc:
            raise CLIError(f"cannot read --file {args.file}: {exc.strerror or exc}") from exc
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{name}:{n}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CLIError(f"{where}: not JSON ({exc.msg})") from exc
                prompt: object
                overrides: dict
                if isinstance(obj, str):
                    prompt, overrides, rid = obj, {}, None
                elif isinstance(obj, dict) and ("prompt" in obj or "messages" in obj):
                    prompt, overrides = _check_line(obj, where)
                    rid = obj.get("id")
                else:
                    raise CLIError(f"{where}: expected a string or an object with 'prompt' or 'messages'")
                try:
                    sampling = sampling_from(args, overrides)
                except CLIError as exc:
                    raise CLIError(f"{where}: {exc}") from exc
                items.append(PromptItem(len(items), prompt, sampling, rid, where, overrides))
    if not items:
        raise CLIError("no prompts: pass prompt texts or --file")
    return items


def report_error(item: PromptItem, error: str) -> None:
    print(f"minisched: request {item.label}: {error}", file=sys.stderr)


def _record(item: PromptItem, out) -> dict:
    rec: dict[str, object] = {"index": item.index}
    if item.id is not None:
        rec["id"] = item.id
    if out.error:
        rec.update(error=out.error, finish_reason="error")
        return rec
    rec.update(
        text=out.text,
        token_ids=out.token_ids,
        finish_reason=out.finish_reason,
        prompt_tokens=len(out.prompt_ids),
        cached_tokens=out.cached_tokens,
        ttft_s=out.ttft,
        e2e_latency_s=out.e2e_latency,
    )
    return rec


def cmd_generate(args) -> int:
    check_output_path(args.record, "--record")
    items = read_prompts(args)
    engine = make_engine(engine_config(args))
    try:
        return _generate(engine, items, args)
    finally:
        if args.record:  # the scheduler's journal and events: `minisched explain` / `minisched replay` read it
            from minisched.observe.run_record import RunRecord, save_runs

            save_runs(args.record, [RunRecord.from_scheduler("generate", engine.scheduler)])


def _generate(engine, items: list[PromptItem], args) -> int:
    prompts, params = [i.prompt for i in items], [i.sampling for i in items]
    if args.stream:
        failed = _stream(engine, items, prompts, params, args)
        return 1 if failed else 0
    status = StatusLine("generate", not args.no_progress and len(items) > 1)
    try:
        outs = engine.generate(
            prompts, params, chat=args.chat, progress=lambda done, total: status({"done": done, "total": total})
        )
    finally:
        status.close()
    failed = 0
    multi = len(items) > 1
    for item, o in zip(items, outs):
        if o.error:
            failed += 1
            report_error(item, o.error)
        if args.json:
            print(json.dumps(_record(item, o)))
        elif o.error:
            continue
        elif multi:
            print(
                f"=== [{item.index}]{' ' + str(item.id) if item.id is not None else ''} ({o.finish_reason}) ===\n"
                f"{o.text}"
            )
        else:
            print(o.text)
            if o.finish_reason in LENGTH_REASONS:
                print(
                    f"minisched: note: stopped at the length limit ({o.finish_reason}: {len(o.token_ids)} tokens)",
                    file=sys.stderr,
                )
    return 1 if failed else 0


def _stream(engine, items: list[PromptItem], prompts, params, args) -> int:
    """Stream to stdout. One prompt: raw text as it comes. Several: each request's text as
    `[i] ` prefixed lines, a line printed once complete. --json: one JSON line per chunk."""
    failed, multi = 0, len(items) > 1
    pending: dict[int, str] = {}  # multi: the unfinished line of each request
    for chunk in engine.stream(prompts, params, chat=args.chat):
        item = items[chunk.index]
        out = chunk.output
        if out is not None and out.error:
            failed += 1
            report_error(item, out.error)
        if args.json:
            rec = {"index": item.index, "delta": chunk.delta, "token_ids": chunk.token_ids}
            if item.id is not None:
                rec["id"] = item.id
            if chunk.finished:
                rec = {**_record(item, out), "delta": chunk.delta, "finished": True}
            print(json.dumps(rec), flush=True)
            continue
        if out is not None and out.error:
            continue
        if not multi:
            sys.stdout.write(chunk.delta)
            if chunk.finished:
                sys.stdout.write("\n")
                if out.finish_reason in LENGTH_REASONS:
                    print(f"minisched: note: stopped at the length limit ({out.finish_reason})", file=sys.stderr)
            sys.stdout.flush()
            continue
        text = pending.get(item.index, "") + chunk.delta
        *lines, rest = text.split("\n")
        for line in lines:
            sys.stdout.write(f"[{item.index}] {line}\n")
        if chunk.finished:
            end = "" if out.finish_reason not in LENGTH_REASONS else "  [stopped: length]"
            sys.stdout.write(f"[{item.index}] {rest}{end}\n" if rest or end else "")
            pending.pop(item.index, None)
        else:
            pending[item.index] = rest
        sys.stdout.flush()
    return failed
