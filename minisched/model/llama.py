"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, optionally tied embeddings) over a ragged batch.

The families' differences (model/config.py, model/families.py) are small pieces of this one module, each
switched on by its ModelConfig field: `add_qkv_bias` (Qwen2's q/k/v biases), `norm_qk_heads` (Qwen3's
per-head q/k RMSNorm, before RoPE), and RoPE's frequencies from model/rope.py (rope_theta, Llama-3's scaling).

One forward computes the new tokens of every request in a batch (prefill chunks and decode
tokens alike, flattened to N rows). Per layer: fused QKV projection, half-rotation RoPE
(transformers' convention), `ops.store_kv` of the new K/V into the paged pool, then paged
attention from `minisched.ops` -- prefill (ragged, causal), decode (one query per request) or
cascade decode (shared prefix + own suffix). All batch metadata comes in a `ForwardMeta`:
there is no module-level state.

Tensor parallelism (minisched/parallel) hooks in at four points through `model.tp`, None by default
(the single-process path, unchanged): the embedding lookup (`tp.embed`), the partial sums after
the O and down projections (`tp.all_reduce`) and the logits (`tp.gather_logits`). A sharded
model holds its rank's heads, MLP columns and vocabulary rows; `minisched.parallel.shard` builds it.

Numerics follow transformers' LlamaForCausalLM: RMSNorm in float32 then cast back; RoPE
cos/sin from float32 `position * inv_freq`; logits in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from minisched import ops
from minisched.model.config import ModelConfig
from minisched.model.linear import Weight, as_tensor, embedding, linear, plain
from minisched.model.packed import PackedWeight
from minisched.model.rope import inv_freq as rope_inv_freq

PageTable = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # kv_indptr, kv_indices, kv_last_page_len


@dataclass
class CascadeMeta:
    """Decode with shared prefixes. The batch rows `rows` (grouped: rows group_indptr[g]:group_indptr[g+1]
    of q[rows] share group g's prefix pages) run cascade attention; the rows `plain_rows` run plain paged
    decode with `plain_table`."""

    rows: torch.Tensor  # int64 [R]
    group_indptr: torch.Tensor  # int32 [G+1] over q[rows]
    prefix_table: PageTable  # one entry per group
    suffix_table: PageTable  # one entry per row of q[rows] (each suffix >= 1 token: the new one)
    plain_rows: torch.Tensor  # int64 [B - R]
    plain_table: PageTable  # one entry per plain row


@dataclass
class ForwardMeta:
    """Everything one forward needs besides the token ids. Index tensors live on the model's device."""

    positions: torch.Tensor  # int64 [N]
    out_slots: torch.Tensor  # int32 [N]: pool slot of each new token's K/V
    qo_indptr: torch.Tensor  # int32 [B+1]
    page_table: PageTable  # over prefix + new tokens, one entry per request
    logits_indices: torch.Tensor  # int64 [B]: rows whose logits are returned
    is_decode: bool = False  # every request has exactly one new token
    cascade: Optional[CascadeMeta] = None  # only with is_decode

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fast_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` as one ATen call (bitwise equal for float32 inputs; tests/model check it)."""
    if x.dtype != torch.float32:
        return rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def fused_cpu_applies(x: torch.Tensor, backend: str) -> bool:
    """The native CPU kernels in float32 have the layer's elementwise tail fused: add + RMSNorm
    (ops.rms_norm), RoPE into contiguous q and k (ops.rope), SiLU * up (ops.silu_and_mul)."""
    return backend == "native" and x.device.type == "cpu" and x.dtype == torch.float32


def add_rms_norm(
    x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float, fused: bool
) -> torch.Tensor:
    """x += delta (the residual add, in place; skipped when None), then RMSNorm(x) * weight."""
    if fused:
        return ops.rms_norm(x, weight, eps, delta=None if delta is None else delta.contiguous())
    if delta is not None:
        x += delta
    return fast_rms_norm(x, weight, eps)


def add_qkv_bias(qkv: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Qwen2: the q, k and v projections' biases (one fused [q + 2 kv] row), added in place after any
    weight kind's linear (packed, int8, GGUF blocks alike)."""
    if bias is not None:
        qkv += bias
    return qkv


def norm_qk_heads(qkv: torch.Tensor, layer: LlamaLayer, cfg: ModelConfig, fused: bool) -> None:
    """Qwen3: RMSNorm over each head of q and of k (weights [head_dim]), in place in the fused qkv rows,
    before RoPE; no-op for a model without (layer.q_norm is None)."""
    if layer.q_norm is None or layer.k_norm is None:
        return
    n, d = qkv.shape[0], cfg.head_dim
    for lo, hi, w in ((0, cfg.q_size, layer.q_norm), (cfg.q_size, cfg.q_size + cfg.kv_size, layer.k_norm)):
        heads = qkv[:, lo:hi].reshape(-1, d).contiguous()  # a copy: the rows of qkv are strided
        normed = ops.rms_norm(heads, w, cfg.rms_eps) if fused else fast_rms_norm(heads, w, cfg.rms_eps)
        qkv[:, lo:hi] = normed.view(n, hi - lo)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]  # [N, 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation RoPE on x [N, H, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [N, 1, D] with its first half negated, for `apply_rope_signed`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in four kernels instead of six: rotate_half(x) * sin == roll(x, D/2) * signed_sin
    exactly (negation is exact), so the result is bitwise the same. x may be a strided view."""
    out = x * cos
    out += torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(sin_signed)
    return out


class TensorParallel(Protocol):
    """`LlamaModel.tp`: the collectives a tensor-parallel rank's forward inserts (parallel/shard.py's TPShard)."""

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_logits(self, logits: torch.Tensor) -> Optional[torch.Tensor]: ...


class LlamaLayer(nn.Module):
    """One decoder layer's weights: the norms, and the projections as plain parameters until
    packed or quantized (model/packed.py, model/quant.py replace them by weight modules)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Weight
    qkv_bias: Optional[torch.Tensor]  # cfg.qkv_bias (Qwen2)
    q_norm: Optional[torch.Tensor]  # cfg.qk_norm (Qwen3), [head_dim] each
    k_norm: Optional[torch.Tensor]
    o: Weight
    gate_up: Weight
    down: Weight

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        def ones(n: int) -> nn.Parameter:
            return nn.Parameter(torch.ones(n, dtype=dtype, device=device), requires_grad=False)

        self.ln1, self.ln2 = ones(h), ones(h)
        self.qkv = param(q + 2 * kv, h)
        self.qkv_bias = param(q + 2 * kv) if cfg.qkv_bias else None
        self.q_norm = ones(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = ones(cfg.head_dim) if cfg.qk_norm else None
        self.o = param(h, q)
        self.gate_up = param(2 * i, h)
        self.down = param(h, i)


class LlamaModel(nn.Module):
    """Weights as plain parameters with fused QKV and gate/up projections (fewer, larger GEMMs)."""

    embed: Union[torch.Tensor, PackedWeight]  # a tied, packed model looks its rows up in the packed LM head
    lm_head: Optional[Weight]  # None: tied to the embedding
    norm: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__()
        self.cfg = cfg
        kw = dict(dtype=dtype, device=device)
        h = cfg.hidden_size
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, h, **kw), requires_grad=False)
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, h, **kw), requires_grad=False)
        )
        self.norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.tp: Optional[TensorParallel] = None  # a minisched.parallel.shard.TPShard on a tensor-parallel rank
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)

    @property
    def decoder_layers(self) -> list[LlamaLayer]:
        """`layers`, typed: nn.ModuleList declares only Modules."""
        return cast("list[LlamaLayer]", list(self.layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @classmethod
    def from_state_dict(
        cls, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype=torch.float32, device="cpu"
    ) -> LlamaModel:
        model = cls(cfg, dtype=dtype, device=device)  # torch.empty parameters: no init cost
        model.load_hf_state_dict(state)
        return model

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights (as minisched.model.weights returns them) into the fused layout. A missing
        tensor is a KeyError; one the model would not read (a bias or a norm of another family, a tensor of
        an unsupported variant) a ValueError naming them: never a model that silently computes something else."""
        read: set[str] = set()

        def get(name):
            if name not in state:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            read.add(name)
            return state[name]

        as_tensor(self.embed).copy_(get("model.embed_tokens.weight"))
        self.norm.copy_(get("model.norm.weight"))
        if self.lm_head is not None:
            as_tensor(self.lm_head).copy_(get("lm_head.weight"))
        elif "lm_head.weight" in state and torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            read.add("lm_head.weight")  # a tied checkpoint that saved the head too
        for idx, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{idx}."
            layer.ln1.copy_(get(p + "input_layernorm.weight"))
            layer.ln2.copy_(get(p + "post_attention_layernorm.weight"))
            as_tensor(layer.qkv).copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            if layer.q_norm is not None and layer.k_norm is not None:
                layer.q_norm.copy_(get(p + "self_attn.q_norm.weight"))
                layer.k_norm.copy_(get(p + "self_attn.k_norm.weight"))
            as_tensor(layer.o).copy_(get(p + "self_attn.o_proj.weight"))
            as_tensor(layer.gate_up).copy_(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
            as_tensor(layer.down).copy_(get(p + "mlp.down_proj.weight"))
        unread = sorted(set(state) - read)
        if unread:
            more = f" and {len(unread) - 4} more" if len(unread) > 4 else ""
            raise ValueError(
                f"{len(unread)} tensors in the checkpoint would be left unread by a {self.cfg.architecture} model "
                f"(qkv_bias={self.cfg.qkv_bias}, qk_norm={self.cfg.qk_norm}, tied={self.cfg.tie_embeddings}): "
                f"{', '.join(unread[:4])}{more}"
            )

    def new_kv_cache(self, num_pages: int, page_size: int) -> torch.Tensor:
        c = self.cfg
        return torch.zeros(
            c.num_layers, 2, num_pages, page_size, c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device
        )

    def _attention(self, q, k_cache, v_cache, meta: ForwardMeta, backend: ops.Backend, check: bool) -> torch.Tensor:
        if meta.cascade is not None:
            c = meta.cascade
            out = torch.empty_like(q)
            out[c.rows] = ops.cascade_decode_attention(
                q[c.rows],
                c.group_indptr,
                k_cache,
                v_cache,
                c.prefix_table,
                c.suffix_table,
                backend=backend,
                check=check,
            )
            if c.plain_rows.numel():
                out[c.plain_rows] = ops.paged_decode_attention(
                    q[c.plain_rows], k_cache, v_cache, *c.plain_table, backend=backend, check=check
                )
            return out
        if meta.is_decode:
            return ops.paged_decode_attention(q, k_cache, v_cache, *meta.page_table, backend=backend, check=check)
        return ops.paged_prefill_attention(
            q, meta.qo_indptr, k_cache, v_cache, *meta.page_table, causal=True, backend=backend, check=check
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: ForwardMeta,
        kv_cache: torch.Tensor,
        *,
        backend: ops.Backend = "torch",
        check: bool = True,
    ) -> Optional[torch.Tensor]:
        """Logits float32 [len(meta.logits_indices), vocab] for a ragged batch; writes the new K/V into kv_cache.
        On a tensor-parallel rank (`self.tp`): the whole vocabulary's logits on rank 0, None on the others.

        Same arithmetic as `dense_forward`, in fewer kernels and temporaries: RoPE on q and k
        together (`apply_rope_signed`), in-place residual adds and SiLU*up, one ATen rms_norm, the pool's
        per-layer views taken once. On the CPU in float32 with the native kernels (`fused_cpu_applies`)
        each of these is one pass: ops.rms_norm (with the residual add), ops.rope (the same bits) and
        ops.silu_and_mul (its own exp: float32 rounding, not ATen's bits)."""
        c = self.cfg
        n = input_ids.shape[0]
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        tp = self.tp
        x = embedding(input_ids, self.embed) if tp is None else tp.embed(input_ids, plain(self.embed))
        cos, sin = rope_cos_sin(meta.positions, self.inv_freq, x.dtype)
        # The residual adds ride along with the next norm: one fused CPU kernel (ops.rms_norm) where it applies.
        fused = fused_cpu_applies(x, backend)
        if fused:  # ops.rope takes each angle once: [N, D/2] (the torch path's values, so the same bits)
            cos, sin = cos[:, 0, : d // 2].contiguous(), sin[:, 0, : d // 2].contiguous()
        else:
            sin = signed_sin(sin)
        pending = None  # the last MLP's output, not yet added to x
        for layer, kv_layer in zip(self.decoder_layers, kv_cache.unbind(0)):
            k_cache, v_cache = kv_layer.unbind(0)
            h = add_rms_norm(x, pending, layer.ln1, c.rms_eps, fused)
            qkv = add_qkv_bias(linear(h, layer.qkv, backend), layer.qkv_bias)
            norm_qk_heads(qkv, layer, c, fused)
            if fused:
                q = ops.rope(qkv[:, : c.q_size].view(n, hq, d), cos, sin)
                k = ops.rope(qkv[:, c.q_size : c.q_size + c.kv_size].view(n, hkv, d), cos, sin)
            else:
                qk = apply_rope_signed(qkv[:, : c.q_size + c.kv_size].view(n, hq + hkv, d), cos, sin)
                q, k = qk[:, :hq].contiguous(), qk[:, hq:]
            v = qkv[:, c.q_size + c.kv_size :].view(n, hkv, d)
            ops.store_kv(k, v, k_cache, v_cache, meta.out_slots, backend=backend, check=check)
            attn = self._attention(q, k_cache, v_cache, meta, backend, check)
            o = linear(attn.view(n, c.q_size), layer.o, backend)
            h = add_rms_norm(x, o if tp is None else tp.all_reduce(o), layer.ln2, c.rms_eps, fused)
            gate_up = linear(h, layer.gate_up, backend)
            if fused:
                act = ops.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate, inplace=True).mul_(up)
            down = linear(act, layer.down, backend)
            pending = down if tp is None else tp.all_reduce(down)
        if pending is not None:
            x += pending
        if not (meta.is_decode and meta.logits_indices.shape[0] == n):  # decode: every row, in order
            x = x[meta.logits_indices]
        x = add_rms_norm(x, None, self.norm, c.rms_eps, fused)
        logits = linear(x, self.embed if self.lm_head is None else self.lm_head, backend).float()
        return logits if tp is None else tp.gather_logits(logits)


def dense_forward(model: LlamaModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-recompute causal forward of ONE sequence with plain dense attention, no pool.
    Returns float32 logits [L, vocab]. A reference for tests and a sanity check."""
    c = model.cfg
    n = input_ids.shape[0]
    with torch.inference_mode():
        x = embedding(input_ids, model.embed)
        cos, sin = rope_cos_sin(torch.arange(n, device=input_ids.device), model.inv_freq, x.dtype)
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        for layer in model.decoder_layers:
            h = rms_norm(x, layer.ln1, c.rms_eps)
            qkv = add_qkv_bias(linear(h, layer.qkv), layer.qkv_bias)
            norm_qk_heads(qkv, layer, c, fused=False)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = apply_rope(q.view(n, c.num_heads, c.head_dim), cos, sin).transpose(0, 1)
            k = apply_rope(k.view(n, c.num_kv_heads, c.head_dim), cos, sin).transpose(0, 1)
            v = v.reshape(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            rep = c.num_heads // c.num_kv_heads
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + linear(attn.transpose(0, 1).reshape(n, c.q_size), layer.o)
            h = rms_norm(x, layer.ln2, c.rms_eps)
            gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down)
        x = rms_norm(x, model.norm, c.rms_eps)
        return linear(x, model.embed if model.lm_head is None else model.lm_head).float()
