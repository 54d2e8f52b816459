"""Megatron-style sharding of a loaded `LlamaModel` over the ranks of a tensor-parallel group.

Rank r of T keeps:

- query heads `[r*Hq/T, (r+1)*Hq/T)` -- its rows of the fused QKV projection (column-parallel)
  and the matching columns of O (row-parallel: each rank's O output is a partial sum,
  all-reduced);
- the KV heads those query heads read: `Hkv/T` of them when T divides Hkv, else (T a multiple
  of Hkv) the one KV head of its query group, replicated on T/Hkv ranks. Its KV pool holds
  only these heads, so the pool per rank shrinks with T (until the heads are replicated);
- MLP columns `[r*I/T, (r+1)*I/T)` of gate and up (column-parallel) and the matching columns of
  down (row-parallel, all-reduced);
- vocabulary rows `[r*ceil(V/T), (r+1)*ceil(V/T))` of the embedding and the LM head (zero rows
  pad the last shard): a token's embedding comes from the rank that holds its row (the others
  give zeros, summed by one all-reduce -- exact), and each rank's logits over its rows are
  gathered on rank 0, where sampling runs.

The norms are replicated (Qwen3's per-head q/k norms too), Qwen2's q/k/v biases split with their rows, and
RoPE's frequencies (rope_theta, Llama-3's scaling) come from the config on every rank; activations between the blocks are replicated on every rank (an
all-reduce leaves the same bytes everywhere). `shard_model` slices a full model and sets its
`tp` hook (`TPShard`), which `LlamaModel.forward` calls at those four points.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from minisched.base.values import cdiv
from minisched.model.config import ModelConfig
from minisched.model.linear import as_tensor
from minisched.model.llama import LlamaModel


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError (one line) if the model cannot be split over `tp` ranks."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor parallelism must be an int >= 1, got {tp!r}")
    if cfg.num_heads % tp:
        raise ValueError(f"--tp {tp} must divide the model's {cfg.num_heads} query heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(
            f"--tp {tp} must divide the model's {cfg.num_kv_heads} KV heads or be a multiple of "
            f"them (then each KV head is replicated)"
        )
    if cfg.intermediate_size % tp:
        raise ValueError(f"--tp {tp} must divide the model's MLP size {cfg.intermediate_size}")


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` holds: [start, stop) of each split dimension."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]  # rows of the padded vocabulary; stop - start == vocab_rows
    vocab_size: int

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int) -> ShardPlan:
        check_tp(cfg, world)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for {world} ranks")
        hq, ffn, rows = cfg.num_heads // world, cfg.intermediate_size // world, cdiv(cfg.vocab_size, world)
        if cfg.num_kv_heads >= world:
            hkv = cfg.num_kv_heads // world
            kv = (rank * hkv, (rank + 1) * hkv)
        else:  # replicated: the KV head of this rank's query group (its heads lie in one group)
            k = rank * cfg.num_kv_heads // world
            kv = (k, k + 1)
        return cls(
            rank,
            world,
            (rank * hq, (rank + 1) * hq),
            kv,
            (rank * ffn, (rank + 1) * ffn),
            (rank * rows, (rank + 1) * rows),
            cfg.vocab_size,
        )

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank computes. `vocab_size` stays the model's: it is the vocabulary the
        model speaks (prompt validation, sampling); the embedding holds `vocab_rows` of it."""
        return replace(
            cfg,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.ffn[1] - self.ffn[0],
        )


class TPShard:
    """`LlamaModel.tp`: the collectives one rank's forward inserts."""

    def __init__(self, group, plan: ShardPlan):
        self.group, self.plan = group, plan

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        local = input_ids.long() - self.plan.vocab[0]
        outside = (local < 0) | (local >= self.plan.vocab_rows)
        x = F.embedding(local.masked_fill(outside, 0), weight)
        x.masked_fill_(outside[:, None], 0.0)
        return self.group.all_reduce(x)  # one rank holds each row: the sum adds zeros, exactly

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        parts = self.group.gather(logits.contiguous())
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.plan.vocab_size]


@torch.no_grad()
def shard_model(model: LlamaModel, group, *, device=None) -> LlamaModel:
    """This rank's shard of a full model (a new LlamaModel on `device`, default the model's), with
    its `tp` hook calling `group`'s collectives (a `TPGroup`)."""
    cfg = model.cfg
    plan = ShardPlan.of(cfg, group.rank, group.world)
    local_cfg = plan.local_config(cfg)
    device = model.device if device is None else torch.device(device)
    out = LlamaModel(replace(local_cfg, vocab_size=plan.vocab_rows), dtype=model.dtype, device=device)
    out.cfg = local_cfg
    d, q_size, kv_size, inter = cfg.head_dim, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    (q0, q1), (k0, k1), (f0, f1), (v0, v1) = plan.q_heads, plan.kv_heads, plan.ffn, plan.vocab

    def vocab_rows(w: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros(plan.vocab_rows, w.shape[1], dtype=w.dtype, device=w.device)
        part = w[v0 : min(v1, cfg.vocab_size)]
        rows[: part.shape[0]] = part
        return rows

    # the ranks shard plain weights (packing and int8 are refused with --tp): as_tensor says so
    as_tensor(out.embed).copy_(vocab_rows(as_tensor(model.embed)))
    if model.lm_head is not None and out.lm_head is not None:
        as_tensor(out.lm_head).copy_(vocab_rows(as_tensor(model.lm_head)))
    out.norm.copy_(model.norm)
    for src, dst in zip(model.decoder_layers, out.decoder_layers):
        qkv, o, gate_up, down = (as_tensor(w) for w in (src.qkv, src.o, src.gate_up, src.down))
        dst.ln1.copy_(src.ln1)
        dst.ln2.copy_(src.ln2)

        def heads(rows: torch.Tensor) -> torch.Tensor:  # this rank's q, k and v rows of the fused projection
            return torch.cat(
                [
                    rows[q0 * d : q1 * d],
                    rows[q_size + k0 * d : q_size + k1 * d],
                    rows[q_size + kv_size + k0 * d : q_size + kv_size + k1 * d],
                ]
            )

        as_tensor(dst.qkv).copy_(heads(qkv))
        if src.qkv_bias is not None and dst.qkv_bias is not None:  # Qwen2: the biases split as their rows
            dst.qkv_bias.copy_(heads(src.qkv_bias))
        if src.q_norm is not None and dst.q_norm is not None and src.k_norm is not None and dst.k_norm is not None:
            dst.q_norm.copy_(src.q_norm)  # Qwen3: per-head weights [head_dim], the same for every head
            dst.k_norm.copy_(src.k_norm)
        as_tensor(dst.o).copy_(o[:, q0 * d : q1 * d])
        as_tensor(dst.gate_up).copy_(torch.cat([gate_up[f0:f1], gate_up[inter + f0 : inter + f1]]))
        as_tensor(dst.down).copy_(down[:, f0:f1])
    out.tp = TPShard(group, plan)
    return out
