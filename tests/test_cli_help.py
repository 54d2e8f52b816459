"""`minisched serve --help` and `generate --help` come from config fields (cli/serve.py's ServeConfig and what
it holds; SamplingParams' fields for the sampling options) and read exactly as the hand-written parser did.

SERVE and SAMPLING are that parser's --help, captured before the options moved onto the fields (100 columns):
every flag, its help and its default stayed. The engine and scheduling groups are EngineConfig's and
SchedulerConfig's (tests/test_cli_flags.py), not repeated here.
"""

from __future__ import annotations

import pytest

from minisched.cli import build_parser

SERVE = """\
options:
  -h, --help            show this help message and exit
  --host HOST           bind address (default: loopback only) (default: 127.0.0.1)
  --port PORT
  --api-key API_KEY     require 'Authorization: Bearer KEY' on /v1 routes (default:
                        $MINISCHED_API_KEY) (default: None)
  --max-queued-requests MAX_QUEUED_REQUESTS
                        requests waiting for their first token beyond this get 429 + Retry-After
                        (default: 512)
  --served-model-name SERVED_MODEL_NAME
                        the model id clients send (default: --model) (default: None)
  --grace-period GRACE_PERIOD
                        seconds in-flight requests may finish after SIGTERM / Ctrl-C before they
                        are aborted (default: 30.0)
  --log-level {debug,info,warning,error}

request bounds (each a 4xx naming its option; docs/serving.md):
  --max-request-body-bytes MAX_REQUEST_BODY_BYTES
                        bytes of a request body, larger: 413 (default 32 MiB)
  --max-choices-per-request MAX_CHOICES_PER_REQUEST
                        prompts x n of one request: each is a request in the engine (default 256)
  --max-stop-chars MAX_STOP_CHARS
                        characters of one stop string (default 256)
  --max-logit-bias MAX_LOGIT_BIAS
                        logit_bias entries (default 1024)
  --max-messages MAX_MESSAGES
                        messages of one chat request (default 4096)
  --max-grammar-bytes MAX_GRAMMAR_BYTES
                        bytes of a json_schema, regex or ebnf (default 64 KiB)

data parallelism:
  --dp DP               engine replicas, each its own process with its own KV pool and radix cache
                        (default: 1)
  --router {cache-aware,round-robin}
                        how --dp routes a request: to the replica caching its longest prefix, or
                        in turn (default: cache-aware)
  --router-cache-threshold ROUTER_CACHE_THRESHOLD
                        cache-aware: the prefix match (share of the prompt) above which it wins
                        over a fresh replica (default: 0.5)
  --router-balance-abs-threshold ROUTER_BALANCE_ABS_THRESHOLD
                        cache-aware: route by load when max - min in-flight requests exceeds this
                        ... (default: 32)
  --router-balance-rel-threshold ROUTER_BALANCE_REL_THRESHOLD
                        ... and max exceeds this times min (default: 1.1)

engine processes:
  --engine-in-process   run the engine on a thread of the server process (no isolation, no
                        restarts) (default: False)
  --engine-heartbeat-timeout ENGINE_HEARTBEAT_TIMEOUT
                        seconds without a heartbeat (sent every 0.5 s) before an engine process
                        counts as hung (default: 10.0)
  --engine-step-timeout ENGINE_STEP_TIMEOUT
                        seconds one engine step may run before the process counts as hung
                        (default: 300.0)
  --engine-max-restarts ENGINE_MAX_RESTARTS
                        restarts of an engine process within 10 minutes before it is given up (0:
                        never restart) (default: 5)

recording (minisched explain / minisched replay read the files; docs/lifecycle.md):
  --record PATH         write each engine process's scheduler journal and events to PATH's series
                        of run files: runs/serve.json ->
                        runs/serve.r<replica>.<start>.p<pid>.<segment>.json (default: None)
  --record-max-bytes RECORD_MAX_BYTES
                        bytes of one record file (16 MiB); past them the next file starts
                        (default: 16777216)
  --record-keep RECORD_KEEP
                        record files kept per replica, the oldest deleted (default: 8)
  --record-interval RECORD_INTERVAL
                        seconds between writes of what is new (the files lag the engine by about
                        this much) (default: 10.0)
"""

SAMPLING = """\
sampling:
  --max-new-tokens MAX_NEW_TOKENS
                        tokens to generate at most per request (default: 128)
  --temperature TEMPERATURE
                        0 is greedy (default: 0.0)
  --top-k TOP_K         sample from the k most likely tokens (-1: all) (default: -1)
  --top-p TOP_P         nucleus sampling mass, in (0, 1] (default: 1.0)
  --seed SEED           per-request sampling seed, in [0, 2**64) (default: None)
  --stop STOP           stop string (repeatable) (default: [])
  --ignore-eos          keep generating past the end-of-sequence token (default: False)
"""


def help_of(command: str, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("MINISCHED_API_KEY", raising=False)  # --api-key's default
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[command].format_help()


def group(text: str, first: str, end: str) -> str:
    """The lines of --help from the group titled `first` up to the one titled `end`."""
    start = text.index(f"\n{first}:\n") + 1
    return text[start : text.index(f"\n\n{end}:\n", start) + 1]


def test_serve_help_is_the_hand_written_one(monkeypatch):
    assert group(help_of("serve", monkeypatch), "options", "engine") == SERVE


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampling_help_is_the_hand_written_one(command, monkeypatch):
    got = group(help_of(command, monkeypatch), "sampling", "engine")
    want = SAMPLING if command == "generate" else SAMPLING.replace("(default: 128)", "(default: 256)")
    assert got == want
