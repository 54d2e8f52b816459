"""What every rank of a tensor-parallel engine loads: a model spec, or a config and a seed (tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minisched.model.config import ModelConfig
from minisched.model.llama import LlamaModel


@dataclass(frozen=True)
class ModelSource:
    """What every rank loads (picklable: it travels to spawned workers). `spec` is a model spec as
    for `Engine(model=...)`; or `config` + `seed` for random weights of any shape (tests), with the
    projections scaled by `weight_scale` (at 1, std 0.02, the embedding dominates and greedy output
    repeats the prompt's last token; at 10 it depends on the whole context)."""

    spec: Optional[str] = None
    config: Optional[ModelConfig] = None
    seed: int = 0
    dtype: torch.dtype = torch.float32
    weight_scale: float = 1.0

    @property
    def name(self) -> str:
        from minisched.model import weights

        return "custom" if self.config is not None else (self.spec or weights.DEFAULT_MODEL)

    def model_config(self) -> ModelConfig:
        """The config alone, cheaply (a GGUF header, a config.json): to validate --tp before loading."""
        from minisched.model import weights

        return self.config if self.config is not None else weights.load_config(self.spec)

    def load(self) -> LlamaModel:
        """The full model on the CPU."""
        from minisched.model import weights

        if self.config is not None:
            cfg, state = weights.dummy_weights(self.config, dtype=self.dtype, seed=self.seed)
            if self.weight_scale != 1.0:
                for name, w in state.items():
                    if name.endswith("_proj.weight"):
                        w.mul_(self.weight_scale)
        else:
            cfg, state = weights.load(self.spec, dtype=self.dtype, seed=self.seed)
        try:
            return LlamaModel.from_state_dict(cfg, state, dtype=self.dtype)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise weights.ModelLoadError(
                f"cannot load the model {self.name}: its weights do not fit its config ({type(exc).__name__}: {exc})"
            ) from None

    def tokenizer(self):
        from minisched.model.tokenizer import MiniTokenizer, load_tokenizer

        if self.config is not None:
            return MiniTokenizer.byte_level(self.config.vocab_size)
        return load_tokenizer(self.spec)
