"""Pure-PyTorch references for every op: the oracle the kernels are tested against.

Written for clarity, one request at a time. Arithmetic runs in float32 for
16-bit inputs and in float64 for float64 inputs; LSE is float32, natural log.
Shapes follow docs/architecture.md ("The paged KV cache and the ops"):

    k_cache, v_cache   [num_pages, page_size, Hkv, D]   (one layer)
    kv_cache           [num_layers, 2, num_pages, page_size, Hkv, D]
    kv_indptr          int32[B+1], kv_indices int32[nnz], kv_last_page_len int32[B]
"""

from __future__ import annotations

import torch

from minisched.base.values import cdiv


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_request_kv(
    cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, b: int
) -> torch.Tensor:
    """Request b's tokens from one layer's K or V cache, in order: [kv_len, Hkv, D] (no pages: kv_len 0)."""
    page_size = cache.shape[1]
    start, end = int(kv_indptr[b]), int(kv_indptr[b + 1])
    pages = kv_indices[start:end].long()
    kv_len = (end - start - 1) * page_size + int(kv_last_page_len[b]) if end > start else 0
    return cache[pages].reshape(-1, *cache.shape[2:])[:kv_len]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of q [Lq, Hq, D] over k, v [Lk, Hkv, D] (GQA by head repeat).

    Causal is bottom-right aligned: query i sees keys j <= Lk - Lq + i.
    Returns out [Lq, Hq, D] in the accumulation dtype and lse [Lq, Hq] float32.
    """
    acc = _acc_dtype(q.dtype)
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf, kf, vf = q.to(acc), k.to(acc).repeat_interleave(group, dim=1), v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * sm_scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        allowed = torch.arange(lk)[None, :] <= (lk - lq + torch.arange(lq))[:, None]
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Lq]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out, lse.transpose(0, 1).to(torch.float32)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write token t's K/V [N, Hkv, D] to slot slot_mapping[t] (skip when < 0)."""
    page_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // page_size, slot % page_size] = k[t]
        v_cache[slot // page_size, slot % page_size] = v[t]


def copy_kv_pages(kv_cache, src_pages, dst_pages) -> None:
    """kv_cache[:, :, dst[i]] = kv_cache[:, :, src[i]] for every i, all layers, K and V.

    dst pages are distinct and disjoint from src pages (the kernels copy in parallel)."""
    for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
        kv_cache[:, :, d] = kv_cache[:, :, s]


def gather_kv_pages(kv_cache, pages, out) -> None:
    """out[:, :, i] = kv_cache[:, :, pages[i]]; out is [L, 2, n, page_size, Hkv, D]."""
    for i, p in enumerate(pages.tolist()):
        out[:, :, i] = kv_cache[:, :, p].to(out.device)


def scatter_kv_pages(src, kv_cache, pages) -> None:
    """kv_cache[:, :, pages[i]] = src[:, :, i] (the inverse of gather_kv_pages)."""
    for i, p in enumerate(pages.tolist()):
        kv_cache[:, :, p] = src[:, :, i].to(kv_cache.device)


def paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out, lse=None):
    """One query token per request, q [B, Hq, D], against the request's whole paged KV."""
    for b in range(q.shape[0]):
        k = gather_request_kv(k_cache, kv_indptr, kv_indices, kv_last_page_len, b)
        v = gather_request_kv(v_cache, kv_indptr, kv_indices, kv_last_page_len, b)
        o, s = attend(q[b : b + 1], k, v, sm_scale, causal=False)
        out[b] = o[0].to(out.dtype)
        if lse is not None:
            lse[b] = s[0]


def paged_prefill_attention(
    q,
    qo_indptr,
    k_cache,
    v_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    causal,
    sm_scale,
    out,
    lse=None,
    kernel=0,
):
    """Ragged queries q [Nq, Hq, D]; request b's queries are the last qo_len_b positions of its KV.
    `kernel` picks a CUDA kernel (the op schema's last argument); ignored here."""
    for b in range(qo_indptr.shape[0] - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if q1 == q0:
            continue
        k = gather_request_kv(k_cache, kv_indptr, kv_indices, kv_last_page_len, b)
        v = gather_request_kv(v_cache, kv_indptr, kv_indices, kv_last_page_len, b)
        o, s = attend(q[q0:q1], k, v, sm_scale, causal=causal)
        out[q0:q1] = o.to(out.dtype)
        if lse is not None:
            lse[q0:q1] = s


def shared_prefix_attention(
    q, group_indptr, k_cache, v_cache, prefix_kv_indptr, prefix_kv_indices, prefix_kv_last_page_len, sm_scale, out, lse
):
    """Rows group_indptr[g]:group_indptr[g+1] of q attend (non-causally) to group g's prefix."""
    paged_prefill_attention(
        q,
        group_indptr,
        k_cache,
        v_cache,
        prefix_kv_indptr,
        prefix_kv_indices,
        prefix_kv_last_page_len,
        False,
        sm_scale,
        out,
        lse,
    )


def merge_attention_states(v_a, lse_a, v_b, lse_b, v_out, lse_out) -> None:
    """Combine two partial attentions over disjoint KV sets: v [N, H, D], lse [N, H] float32."""
    acc = _acc_dtype(v_a.dtype)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both empty: keep weights finite
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    merged = (v_a.to(acc) * wa[..., None] + v_b.to(acc) * wb[..., None]) / torch.where(total > 0, total, 1)[..., None]
    v_out.copy_(merged.to(v_out.dtype))
    lse_out.copy_((m + torch.log(total)).to(torch.float32))


def dequantize_int8(w_q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] weights from int8 values [N, K] and per-group scales [N, K // G]."""
    group = w_q.shape[1] // scales.shape[1]
    return w_q.to(dtype) * scales.to(dtype).repeat_interleave(group, dim=1)


def pack_int8_weight(w_q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_linear's layout, 16-column panels (zero past N) with the input channels in pairs, the
    operand order of the int16 dot-product instructions (vpmaddwd / vpdpwssd):
    w_packed [P, K / 2, 32] with w_packed[p, i, 2 j + t] = w_q[16 p + j, 2 i + t], and
    s_packed [P, K / G, 16] with s_packed[p, g, j] = scales[16 p + j, g]."""
    n, k = w_q.shape
    panels = cdiv(n, 16)
    w = w_q.new_zeros(panels * 16, k)
    w[:n] = w_q
    s = scales.new_zeros(panels * 16, scales.shape[1])
    s[:n] = scales
    w_packed = w.view(panels, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(panels, k // 2, 32).contiguous()
    return w_packed, s.view(panels, 16, -1).transpose(1, 2).contiguous()


def unpack_int8_weight(w_packed: torch.Tensor, s_packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_int8_weight: (w_q [N, K], scales [N, K // G])."""
    panels, pairs, _ = w_packed.shape
    w_q = w_packed.view(panels, pairs, 16, 2).permute(0, 2, 1, 3).reshape(panels * 16, 2 * pairs)[:n]
    return w_q, s_packed.transpose(1, 2).reshape(panels * 16, -1)[:n]


INT16_MAX = 32767
INT32_BLOCK = 256  # input channels per int32 partial sum: 256 x 32767 x 127 < 2^31


def quantize_rows_int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_linear's activations: each row of x [M, K] as int16 values q and one float32 scale, the
    row's max |x| over 32767 (rows of zeros: q = 0, scale 0). The float32 arithmetic the kernels
    use: inv = 32767 / amax, q = round-half-even(x * inv), scale = amax / 32767."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
    nonzero = amax > 0
    inv = torch.where(nonzero, torch.full_like(amax, float(INT16_MAX)) / torch.where(nonzero, amax, 1), 0)
    q = torch.round(x * inv).clamp_(-INT16_MAX, INT16_MAX)
    return q.to(torch.int16), (amax / torch.tensor(float(INT16_MAX))).squeeze(1)


def int8_linear(x: torch.Tensor, w_packed: torch.Tensor, s_packed: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ W.T for the int8 weight W = w_q * scales, with x's rows quantized to int16 as the
    kernels do (quantize_rows_int16): out[m, n] = scale[m] * sum_g scales[n, g] * sum_{k in g} q[m, k]
    w_q[n, k], in float64 (the integer sums are exact)."""
    n = out.shape[1]
    w_q, scales = unpack_int8_weight(w_packed, s_packed, n)
    q, sx = quantize_rows_int16(x)
    out.copy_((q.double() * sx.double()[:, None]) @ dequantize_int8(w_q, scales, torch.float64).T)


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels [ceil(N / 16), K, 16]: w_packed[p, k, j] = w[16 p + j, k], zero past N."""
    n, k = w.shape
    panels = cdiv(n, 16)
    padded = w.new_zeros(panels * 16, k)
    padded[:n] = w
    return padded.view(panels, 16, k).transpose(1, 2).contiguous()


def unpack_linear_weight(w_packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_linear_weight: the [N, K] weight."""
    panels, k, width = w_packed.shape
    return w_packed.transpose(1, 2).reshape(panels * width, k)[:n]


def packed_linear(x: torch.Tensor, w_packed: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ w.T for the packed weight, accumulated in float64."""
    out.copy_(x.double() @ unpack_linear_weight(w_packed, out.shape[1]).double().T)


def rms_norm(x: torch.Tensor, delta, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """x += delta (when given), then out = x / sqrt(mean(x^2) + eps) * weight, in float64."""
    if delta is not None:
        x.add_(delta)
    xd = x.double()
    out.copy_(weight.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)))


def silu_and_mul(x: torch.Tensor, out: torch.Tensor) -> None:
    """out = silu(gate) * up for x = [gate | up] [M, 2D], in float64."""
    g, u = x.double().chunk(2, dim=-1)
    out.copy_(g / (1 + torch.exp(-g)) * u)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """Half-rotation RoPE, in float64: out = x * [cos, cos] + [-x2, x1] * [sin, sin] for x = [x1 | x2]
    [N, H, D] and cos, sin [N, D/2] (the same angle for element j and j + D/2)."""
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    out.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


# GGUF block formats (GGML type id: bytes per block of 32 input channels): Q4_0, Q4_1, Q8_0.
GGUF_BLOCK = 32
GGUF_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}


def dequantize_gguf(blocks: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] weights from GGUF blocks [N, K / 32 * block bytes] (uint8) of type qtype, computed as
    gguf.quants.dequantize does (float32: d * q rounded, then + m rounded; float64: exact):
    Q4_0 d * (q - 8), Q4_1 d * q + m, Q8_0 q * d, with the 4-bit q of channel c < 16 the low nibble of
    byte c and of channel c >= 16 the high nibble of byte c - 16."""
    n, nbytes = blocks.shape
    size = GGUF_BLOCK_BYTES[qtype]
    b = blocks.reshape(n, nbytes // size, size)
    d = b[..., 0:2].contiguous().view(torch.float16).to(dtype)
    if qtype == 8:
        w = b[..., 2:].contiguous().view(torch.int8).to(dtype) * d
    else:
        qs = b[..., 4:] if qtype == 3 else b[..., 2:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(dtype)
        if qtype == 2:
            w = d * (q - 8)
        else:
            w = d * q + b[..., 2:4].contiguous().view(torch.float16).to(dtype)
    return w.reshape(n, -1)


def _panel_scales(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The blocks [N, K / 32 * block bytes] in panels of 16 rows (zero blocks past N), [P, KB, 16 rows, block
    bytes], and the head of each panel-block: the 16 rows' d, then their m (Q4_1), [P, KB, 32] each."""
    n, nbytes = blocks.shape
    size = GGUF_BLOCK_BYTES[qtype]
    nb, panels = nbytes // size, cdiv(n, 16)
    padded = blocks.new_zeros(panels * 16, nb, size)
    padded[:n] = blocks.reshape(n, nb, size)
    b = padded.view(panels, 16, nb, size).permute(0, 2, 1, 3)
    parts = [b[..., 0:2].reshape(panels, nb, 32)]
    if qtype == 3:
        parts.append(b[..., 2:4].reshape(panels, nb, 32))
    return b, parts


def _head(qtype: int) -> int:
    """Bytes before the quants in a GGUF block: d, and m for Q4_1."""
    return 4 if qtype == 3 else 2


def _from_panels(w8: torch.Tensor, qtype: int, n: int, quants: torch.Tensor) -> torch.Tensor:
    """The GGUF blocks [N, K / 32 * block bytes] of packed panel-blocks w8 (uint8 [P, KB, 16 x block bytes],
    the rows' d, then m for Q4_1, then the quants), with `quants` [P, KB, 16 rows, quant bytes] the latter
    already put back in row order (each layout has its own)."""
    panels, nb, _ = w8.shape
    rows = [w8[..., 0:32].reshape(panels, nb, 16, 2)]
    if qtype == 3:
        rows.append(w8[..., 32:64].reshape(panels, nb, 16, 2))
    b = torch.cat(rows + [quants], dim=-1)  # [P, KB, 16 rows, block bytes]
    return b.permute(0, 2, 1, 3).reshape(panels * 16, -1)[:n]


def pack_gguf_weight(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """gguf_linear's layout: panels of 16 rows (zero blocks past N), per panel and block of 32 channels
    one panel-block of 16 x block bytes: the 16 rows' d (fp16), their m (Q4_1), then the quants with
    the rows innermost (Q4: [16 bytes][16 rows], byte j holding channels j and j + 16; Q8: [32][16]).
    Returns uint8 [ceil(N / 16), K / 32, 16 x block bytes]."""
    b, parts = _panel_scales(blocks, qtype)
    panels, nb = b.shape[:2]
    parts.append(b[..., _head(qtype) :].transpose(-1, -2).reshape(panels, nb, -1))
    return torch.cat(parts, dim=-1).contiguous()


def unpack_gguf_weight(w_packed: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """The inverse of pack_gguf_weight: the GGUF blocks [N, K / 32 * block bytes]."""
    panels, nb, _ = w_packed.shape
    quants = w_packed[..., 16 * _head(qtype) :].reshape(panels, nb, -1, 16).transpose(-1, -2)
    return _from_panels(w_packed, qtype, n, quants)


def gguf_linear(x: torch.Tensor, w_packed: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
    """out = x @ W.T for the GGUF-block weight W (exactly dequantized), accumulated in float64."""
    w = dequantize_gguf(unpack_gguf_weight(w_packed, qtype, out.shape[1]), qtype, torch.float64)
    out.copy_(x.double() @ w.T)


# gguf_a8_linear: the same blocks, against activations rounded to 8 bits per block of 32 channels.
A8_OFFSET = {2: 8, 3: 0, 8: 128}  # the kernel's unsigned weight byte minus the signed value (Q8_0: w ^ 0x80)


def quantize_a8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32, K a multiple of 32) rounded to 8 bits per block of 32 channels, in float32 as
    gguf_a8_linear computes it: amax = max |x| of the block, dx = amax / 127, xq = round(x * (127 /
    amax)) (half to even; 0 where amax is 0). A block holding inf or NaN gets xq = 0 and dx = NaN, so
    every output of its row is NaN. Returns (xq int8 [M, K], dx float32 [M, K / 32]); the activation
    the products see is x^ = dx * xq."""
    m, k = x.shape
    xb = x.float().reshape(m, k // GGUF_BLOCK, GGUF_BLOCK)
    amax = xb.abs().amax(dim=-1)
    finite = torch.isfinite(xb).all(dim=-1)
    dx = torch.where(finite, amax / 127, torch.full_like(amax, float("nan")))
    inv = torch.where(finite & (amax > 0), 127 / amax, torch.zeros_like(amax))
    xq = torch.round(torch.where(finite[..., None], xb, 0) * inv[..., None]).clamp(-127, 127)
    return xq.to(torch.int8).reshape(m, k), dx


def pack_gguf_a8_weight(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """gguf_a8_linear's layout: pack_gguf_weight's panel-blocks (16 rows x 32 channels, the 16 rows' d,
    then m for Q4_1) with the quants in 32-bit lanes, one row per lane: Q4 [4][16 rows][4 bytes], lane
    g of row r holding its bytes 4g..4g+3 (channels 4g..4g+3 in the low nibbles, 16+4g.. in the high);
    Q8 [8][16][4], channels 4g..4g+3. Returns int32 [ceil(N / 16), K / 32, 4 x block bytes]: one
    vpdpbusd operand per 64 bytes (the dtype also tells it apart from pack_gguf_weight's uint8)."""
    b, parts = _panel_scales(blocks, qtype)
    panels, nb = b.shape[:2]
    qs = b[..., _head(qtype) :]  # [P, KB, 16, Q] with Q = 16 or 32
    parts.append(qs.reshape(panels, nb, 16, -1, 4).transpose(2, 3).reshape(panels, nb, -1))
    return torch.cat(parts, dim=-1).contiguous().view(torch.int32)


def unpack_gguf_a8_weight(w_packed: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """The inverse of pack_gguf_a8_weight: the GGUF blocks [N, K / 32 * block bytes]."""
    panels, nb, _ = w_packed.shape
    w8 = w_packed.contiguous().view(torch.uint8)
    quants = w8[..., 16 * _head(qtype) :].reshape(panels, nb, -1, 16, 4).transpose(2, 3).reshape(panels, nb, 16, -1)
    return _from_panels(w8, qtype, n, quants)


def gguf_a8_linear(x: torch.Tensor, w_packed: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
    """out = x^ @ W.T in float64: W the exactly dequantized blocks, x^ = dx * xq the activations rounded
    by quantize_a8 (float32 x; a float64 x is rounded to float32 first)."""
    xq, dx = quantize_a8(x.float())
    m, k = xq.shape
    xh = xq.double().reshape(m, k // GGUF_BLOCK, GGUF_BLOCK) * dx.double()[..., None]
    w = dequantize_gguf(unpack_gguf_a8_weight(w_packed, qtype, out.shape[1]), qtype, torch.float64)
    out.copy_(xh.reshape(m, k) @ w.T)
