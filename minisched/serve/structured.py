"""Structured outputs on the HTTP side: a grammar that does not parse is a 400 before admission.

Parsing (xgrammar's `Grammar.from_*`, no vocabulary) takes well under a millisecond; compiling
against the vocabulary is the engine's, off its critical path (engine/structured.py).
"""

from __future__ import annotations

import json

from minisched.serve.protocol import APIError

PARAM = {"json_schema": "response_format", "json_object": "response_format", "regex": "regex", "ebnf": "ebnf"}


def check_grammar(kind: str, spec: str) -> None:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise APIError(400, f"structured outputs need the xgrammar package ({exc})", param=PARAM[kind]) from exc
    try:
        if kind == "json_schema":
            json.loads(spec)
            xgr.Grammar.from_json_schema(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError) as exc:
        why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        why = why.split(": ", 1)[-1] if why.startswith("[") else why  # drop xgrammar's "[time] file:line:" prefix
        raise APIError(400, f"invalid {kind} grammar: {why}", param=PARAM[kind], code="invalid_grammar") from exc
