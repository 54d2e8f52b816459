"""Helpers for the `serve --record` tests: drive an EngineLoop with client ids, and run the CLI on record files."""

from __future__ import annotations

import asyncio
import threading

from minisched.cli import main
from minisched.sched.sampling_params import SamplingParams


class DoneSink:
    """A Sink that notes its request's end (EngineLoop publishes to `loop`; deliver runs there)."""

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop):
        self.rid, self.loop, self.done = rid, loop, threading.Event()

    def deliver(self, update) -> None:
        if update.finish_reason is not None:
            self.done.set()


def drive(loop, n: int, *, prompt_len: int = 40, max_new_tokens: int = 20, timeout: float = 120.0) -> list[str]:
    """Submit n one-choice calls `call<k>` with client ids `client-<k>` (prompts that share little), wait
    for all to end; returns the client ids."""
    aloop = asyncio.new_event_loop()
    thread = threading.Thread(target=aloop.run_forever, daemon=True)
    thread.start()
    sinks, clients = [], []
    try:
        for k in range(n):
            sink = DoneSink(f"call{k}-0", aloop)
            prompt = [5 + (k * 7 + j) % 100 for j in range(prompt_len)]
            sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            loop.submit([sink.rid], prompt, sampling, [sink], f"client-{k}")
            sinks.append(sink)
            clients.append(f"client-{k}")
        for sink in sinks:
            assert sink.done.wait(timeout), f"{sink.rid} did not finish"
    finally:
        aloop.call_soon_threadsafe(aloop.stop)
        thread.join(5)
    return clients


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err
