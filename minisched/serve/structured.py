"""Structured outputs on the HTTP side: a grammar that does not parse is a 400 before admission.

Parsing (xgrammar's `Grammar.from_*`, no vocabulary) takes well under a millisecond; compiling
against the vocabulary is the engine's, off its critical path (engine/structured.py).
"""

from __future__ import annotations

import json

from minisched.serve.protocol import APIError


def check_grammar(kind: str, spec: str, param: str) -> None:
    """APIError(400) naming the body's field `param` for a grammar that does not parse."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise APIError(400, f"structured outputs need the xgrammar package ({exc})", param=param) from exc
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
        raise APIError(400, f"{param}: invalid {kind} grammar: {why}", param=param, code="invalid_grammar") from exc
