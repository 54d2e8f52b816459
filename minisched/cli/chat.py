"""`minisched chat`: an interactive multi-turn chat on one engine.

Each turn sends the whole conversation, rendered with the model's chat template. The
previous turns' KV is still in the radix cache (a finished request's pages stay there until
evicted), so only the new turn is prefilled: the line after each reply shows how many prompt
tokens came from the cache. `/reset` starts a new conversation, `/exit` (or Ctrl-D) quits;
Ctrl-C stops the reply being written (the request is aborted and its pages released).
"""

from __future__ import annotations

import sys

from minisched.cli.common import engine_config, make_engine, sampling_from

HELP = "commands: /reset (new conversation), /exit (quit); Ctrl-C stops a reply"


def _read(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def cmd_chat(args, read=_read, out=sys.stdout) -> int:
    engine = make_engine(engine_config(args))
    sampling = sampling_from(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"minisched chat on {engine.model_name} ({HELP})", file=out)
    while True:
        try:
            line = read("you> ")
        except KeyboardInterrupt:
            line = None
        if line is None or line.strip() == "/exit":
            print(file=out)
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(system)
            print("(new conversation)", file=out)
            continue
        messages.append({"role": "user", "content": text})
        reply, final = [], None
        out.write("assistant> ")
        try:
            for chunk in engine.stream([messages], sampling):
                out.write(chunk.delta)
                out.flush()
                reply.append(chunk.delta)
                if chunk.finished:
                    final = chunk.output
        except KeyboardInterrupt:
            out.write(" [interrupted]\n")
            messages.pop()  # the unanswered turn is not part of the conversation
            continue
        out.write("\n")
        if final is None or final.error:
            print(f"(error: {final.error if final else 'no output'})", file=out)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": final.text})
        print(
            f"  [{final.cached_tokens}/{len(final.prompt_ids)} prompt tokens from the cache, "
            f"{len(final.token_ids)} generated, {final.finish_reason}]",
            file=out,
        )
