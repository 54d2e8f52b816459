"""Sample inputs for every op: small, fresh random argument lists, valid on a given device and dtype.

`samples.<op>(device, dtype, gen)` returns a list of the op's full argument lists (outputs preallocated),
one per case worth checking apart (an optional output given or not, causal or not, the residual add or not,
a strided view). The op table (ops/table.py) points each op at its builder; tests/ops/test_opcheck.py runs
every list through torch.library.opcheck. `dtype` is the floating dtype of the activations and caches
(OpSpec.dtypes: those the native kernels take); index tensors are int32 and LSE float32 whatever it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np
import torch

from minisched.base.page_table import build_csr
from minisched.base.values import cdiv
from minisched.ops import reference

Sampler = Callable[[torch.device, torch.dtype, torch.Generator], list[tuple]]


def _randn(shape: Sequence[int], device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen).to(device=device, dtype=dtype)


def _int32(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _indptr(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    return _int32(list(accumulate(sizes, initial=0)), device)


def _paged_kv(
    kv_lens: Sequence[int],
    page_size: int,
    hkv: int,
    d: int,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    """One layer's random (k_cache, v_cache) with the page table (kv_indptr, kv_indices, kv_last_page_len)
    of requests of kv_lens tokens, their pages shuffled over the pool (one page spare)."""
    need = [cdiv(n, page_size) for n in kv_lens]
    pool = torch.randperm(sum(need) + 1, generator=gen).tolist()
    starts = accumulate(need, initial=0)
    table = build_csr([pool[a : a + c] for a, c in zip(starts, need)], kv_lens, page_size)
    shape = (len(pool), page_size, hkv, d)
    caches = (_randn(shape, device, dtype, gen), _randn(shape, device, dtype, gen))
    return (*caches, *(torch.from_numpy(a).to(device) for a in table))


# -- KV cache movement ---------------------------------------------------------------------------


def store_kv(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    k_cache, v_cache = _randn((4, 4, 2, 8), device, dtype, gen), _randn((4, 4, 2, 8), device, dtype, gen)
    k, v = _randn((5, 2, 8), device, dtype, gen), _randn((5, 2, 8), device, dtype, gen)
    return [(k, v, k_cache, v_cache, _int32([0, 9, -1, 4, 15], device))]  # -1: a padding row, skipped


def _pool(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return _randn((2, 2, 6, 4, 2, 8), device, dtype, gen)  # [L, 2, num_pages, page_size, Hkv, D]


def copy_kv_pages(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    return [(_pool(device, dtype, gen), _int32([0, 1], device), _int32([4, 5], device))]


def gather_kv_pages(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    kv = _pool(device, dtype, gen)
    return [(kv, _int32([5, 0, 3], device), kv.new_zeros((2, 2, 3, 4, 2, 8)))]


def scatter_kv_pages(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    return [(_randn((2, 2, 3, 4, 2, 8), device, dtype, gen), _pool(device, dtype, gen), _int32([5, 0, 3], device))]


# -- attention -----------------------------------------------------------------------------------


def _lse(q: torch.Tensor) -> torch.Tensor:
    return q.new_zeros(q.shape[:2], dtype=torch.float32)


def paged_decode_attention(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    kv = _paged_kv([5, 20], 16, 2, 64, device, dtype, gen)
    q = _randn((2, 4, 64), device, dtype, gen)
    return [(q, *kv, 0.125, torch.zeros_like(q), lse) for lse in (_lse(q), None)]


def paged_prefill_attention(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    """Causal with the LSE, and not causal without it and with `kernel` given (0: auto, every device)."""
    k_cache, v_cache, *table = _paged_kv([5, 20], 16, 2, 64, device, dtype, gen)
    q = _randn((9, 4, 64), device, dtype, gen)
    head = (q, _indptr([4, 5], device), k_cache, v_cache, *table)
    return [(*head, True, 0.125, torch.zeros_like(q), _lse(q)), (*head, False, 0.125, torch.zeros_like(q), None, 0)]


def shared_prefix_attention(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    k_cache, v_cache, *prefix_table = _paged_kv([16, 5], 16, 2, 64, device, dtype, gen)
    q = _randn((4, 4, 64), device, dtype, gen)
    return [(q, _indptr([3, 1], device), k_cache, v_cache, *prefix_table, 0.125, torch.zeros_like(q), _lse(q))]


def merge_attention_states(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    v_a, v_b = _randn((5, 3, 64), device, dtype, gen), _randn((5, 3, 64), device, dtype, gen)
    lse_a, lse_b = _randn((5, 3), device, torch.float32, gen), _randn((5, 3), device, torch.float32, gen)
    return [(v_a, lse_a, v_b, lse_b, torch.zeros_like(v_a), torch.zeros_like(lse_a))]


# -- CPU matmuls -----------------------------------------------------------------------------------


def int8_linear(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    """N = 17: a full panel of 16 output columns and a partial one; groups of 32 input channels."""
    w_q = torch.randint(-127, 128, (17, 64), generator=gen, dtype=torch.int8)
    scales = torch.rand(17, 2, generator=gen) * 0.02 + 1e-3
    w_packed, s_packed = (t.to(device) for t in reference.pack_int8_weight(w_q, scales))
    return [(_randn((3, 64), device, dtype, gen), w_packed, s_packed, torch.zeros(3, 17, device=device, dtype=dtype))]


def packed_linear(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    """A partial panel (N = 17) over K = 40, one row over one full panel, and a bfloat16 weight."""
    cases = []
    for m, n, k, w_dtype in ((3, 17, 40, dtype), (1, 16, 64, dtype), (2, 17, 40, torch.bfloat16)):
        w_packed = reference.pack_linear_weight(torch.randn(n, k, generator=gen)).to(device=device, dtype=w_dtype)
        cases.append((_randn((m, k), device, dtype, gen), w_packed, torch.zeros(m, n, device=device, dtype=dtype)))
    return cases


GGUF_SAMPLE_QTYPES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0: GGML's type ids


def _gguf_blocks(n: int, k: int, qtype: int, gen: torch.Generator) -> torch.Tensor:
    """gguf's own quantization of a random weight (rows of different scales): uint8 blocks [n, k / 32 * block bytes]."""
    from gguf.constants import GGMLQuantizationType  # the GGUF file library (a dependency), loaded when used
    from gguf.quants import quantize

    w = torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) * 0.1 + 0.01)
    blocks = quantize(w.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(n, -1)


def _gguf_cases(
    pack: Callable[[torch.Tensor, int], torch.Tensor], device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> list[tuple]:
    """One case per block format, N = 17 (a full panel of 16 rows and a partial one), K = 64."""
    return [
        (
            _randn((3, 64), device, dtype, gen),
            pack(_gguf_blocks(17, 64, qtype, gen), qtype).to(device),
            qtype,
            torch.zeros(3, 17, device=device, dtype=dtype),
        )
        for qtype in GGUF_SAMPLE_QTYPES
    ]


def gguf_linear(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    return _gguf_cases(reference.pack_gguf_weight, device, dtype, gen)


def gguf_a8_linear(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    return _gguf_cases(reference.pack_gguf_a8_weight, device, dtype, gen)


# -- norm and the elementwise tail of a layer ------------------------------------------------------


def rms_norm(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    """Without and with the fused residual add (x mutated too)."""
    cases = []
    for fused in (False, True):
        x = _randn((5, 20), device, dtype, gen)
        delta = _randn((5, 20), device, dtype, gen) if fused else None
        cases.append((x, delta, _randn((20,), device, dtype, gen), 1e-5, torch.zeros_like(x)))
    return cases


def silu_and_mul(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    return [(_randn((5, 40), device, dtype, gen), torch.zeros(5, 20, device=device, dtype=dtype))]


def rope(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[tuple]:
    """x a strided view: the q columns [N, H, D] of a fused qkv projection's output [N, (H + 2) D]."""
    qkv = _randn((5, 5 * 8), device, dtype, gen)
    angles = _randn((5, 4), device, dtype, gen)
    x = qkv[:, : 3 * 8].view(5, 3, 8)
    return [(x, torch.cos(angles), torch.sin(angles), torch.zeros(5, 3, 8, device=device, dtype=dtype))]
