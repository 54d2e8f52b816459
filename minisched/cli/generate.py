"""`minisched generate`: prompts from the command line or a JSON-lines file, printed or streamed."""
from __future__ import annotations

import json
import sys

from minisched.cli.common import SAMPLING_FIELDS, CLIError, make_engine, sampling_from


def read_prompts(args) -> list[tuple[object, dict]]:
    items: list[tuple[object, dict]] = [(text, {}) for text in args.prompts]
    if args.file:
        f = sys.stdin if args.file == "-" else None
        try:
            f = f or open(args.file)
        except OSError as exc:
            raise CLIError(f"cannot read --file: {exc}") from exc
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CLIError(f"{args.file}:{n}: not JSON ({exc.msg})") from exc
                if isinstance(obj, str):
                    items.append((obj, {}))
                elif isinstance(obj, dict) and ("prompt" in obj or "messages" in obj):
                    unknown = set(obj) - {"prompt", "messages", "id"} - set(SAMPLING_FIELDS)
                    if unknown:
                        raise CLIError(f"{args.file}:{n}: unknown fields {sorted(unknown)}")
                    items.append((obj.get("messages", obj.get("prompt")),
                                  {k: (tuple(v) if isinstance(v, list) else v) for k, v in obj.items()
                                   if k in SAMPLING_FIELDS}))
                else:
                    raise CLIError(f"{args.file}:{n}: expected a string or an object with 'prompt' or 'messages'")
    if not items:
        raise CLIError("no prompts: pass prompt texts or --file")
    return items


def cmd_generate(args) -> int:
    items = read_prompts(args)
    params = [sampling_from(args, o) for _, o in items]
    engine = make_engine(args)
    prompts = [p for p, _ in items]
    multi = len(prompts) > 1
    failed = 0
    if args.stream and not args.json:
        for chunk in engine.stream(prompts, params, chat=args.chat):
            if chunk.output is not None and chunk.output.error:
                print(f"error: prompt {chunk.index}: {chunk.output.error}", file=sys.stderr)
                failed += 1
                continue
            prefix = f"[{chunk.index}] " if multi else ""
            if chunk.delta:
                sys.stdout.write(prefix + chunk.delta + ("\n" if multi else ""))
                sys.stdout.flush()
            if chunk.finished and not multi:
                sys.stdout.write("\n")
        return 1 if failed else 0
    outs = engine.generate(prompts, params, chat=args.chat)
    for o in outs:
        if o.error:
            failed += 1
            print(f"error: prompt {o.index}: {o.error}", file=sys.stderr)
            if args.json:
                print(json.dumps({"index": o.index, "error": o.error}))
            continue
        if args.json:
            print(json.dumps({"index": o.index, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason, "prompt_tokens": len(o.prompt_ids),
                              "cached_tokens": o.cached_tokens, "ttft_s": o.ttft, "e2e_latency_s": o.e2e_latency}))
        elif multi:
            print(f"=== [{o.index}] ({o.finish_reason}) ===\n{o.text}")
        else:
            print(o.text)
    return 1 if failed else 0
