"""A grammar compile worker: a process of its own that the engine can kill (engine/structured.py).

Run as a script (`python grammar_worker.py`, not `-m`: it imports xgrammar only, so it starts in a
fraction of a second). On stdin, length-prefixed pickles: first ("init", tokenizer info json), then
("compile", kind, spec) each; on stdout, ("ready",) once started, then ("ok", compiled grammar
json) or ("error", message) per compile. xgrammar's compile time grows faster than the grammar (a 28 kB JSON schema: 6 s, 115 kB:
6 min on a 512-token vocabulary), and a native call cannot be interrupted: a compile past its
deadline is ended by killing this process.
"""

from __future__ import annotations

import pickle
import struct
import sys

HEADER = struct.Struct("<I")


def read_frame(stream):
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    return pickle.loads(stream.read(n))


def write_frame(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def compile_one(compiler, kind: str, spec: str):
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "json_schema":  # compact JSON: no free whitespace for a model to loop in
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_grammar(spec)


def main() -> None:
    import xgrammar as xgr

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    init = read_frame(inp)
    info = xgr.TokenizerInfo.deserialize_json(init[1])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    write_frame(out, ("ready",))  # started (importing xgrammar takes seconds): compile deadlines count from here
    while (msg := read_frame(inp)) is not None:
        _, kind, spec = msg
        try:
            write_frame(out, ("ok", compile_one(compiler, kind, spec).serialize_json()))
        except Exception as exc:  # noqa: BLE001 -- handed to the engine as the request's error
            write_frame(out, ("error", f"{type(exc).__name__}: {exc}".strip()))


if __name__ == "__main__":
    main()
