"""The engine layer: ModelRunner turns a scheduler batch into model inputs; Engine runs the loop
(schedule -> forward -> sample -> process results) behind `generate` and `stream`."""

from minisched.engine.engine import Engine, Output, StreamChunk

__all__ = ["Engine", "Output", "StreamChunk"]
