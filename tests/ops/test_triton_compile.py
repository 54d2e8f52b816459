"""Every Triton kernel compiles for Hopper (sm_90) without a GPU; registers and spills are printed.

The kernels are compiled by triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) in a
subprocess without TRITON_INTERPRET (conftest.py sets it for this process, and under it
@triton.jit gives interpreted functions that cannot be compiled). Registers and spills come from
`cuobjdump -res-usage` (shipped in the triton package) on each cubin: STACK or LOCAL bytes > 0
means ptxas spilled. Run this file directly to print the table.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# -- the variants: (module, kernel, pointer dtypes by argument, constexprs, num_warps) --------------
# Pointer arguments default to the data dtype "{dt}"; ints default to i32; *_scale to fp32.
IDX = {
    name: "*i32"
    for name in (
        "slot_ptr",
        "src_pages_ptr",
        "dst_pages_ptr",
        "kv_indptr_ptr",
        "kv_indices_ptr",
        "kv_last_ptr",
        "qo_indptr_ptr",
        "tile_req_ptr",
        "tile_first_ptr",
    )
}
F32 = {name: "*fp32" for name in ("la_ptr", "lb_ptr", "lo_ptr", "lse_ptr", "po_ptr", "plse_ptr")}


def _variants():
    from minisched.triton_kernels.paged_decode_attention import DECODE_STAGES, MAX_SPLITS
    from minisched.triton_kernels.paged_prefill_attention import PREFILL_STAGES, prefill_tile

    out = []
    for dt in ("bf16", "fp16"):
        for d in (128, 64):
            out.append(
                (
                    "store_kv",
                    "_store_kv_kernel",
                    {},
                    dict(HEAD_DIM=d, BLOCK_T=2048 // (8 * d), BLOCK_H=8, BLOCK_D=d),
                    4,
                    None,
                    dt,
                    d,
                )
            )
            out.append(
                (
                    "merge_attention_states",
                    "_merge_kernel",
                    {},
                    dict(HEAD_DIM=d, BLOCK_H=2048 // d, BLOCK_D=d),
                    4,
                    None,
                    dt,
                    d,
                )
            )
            # decode: every group runs the tl.dot path (padded to 16 rows); split partials are fp32
            # (one split writes the output directly: compiled for group 8 only, to save time)
            for group in (8, 1, 3):
                for o_type in (dt, "fp32") if group == 8 else ("fp32",):
                    out.append(
                        (
                            "paged_decode_attention",
                            "_decode_split_kernel",
                            {"o_ptr": "*" + o_type},
                            dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=d, BLOCK_N=64, HAS_LSE=True, IEEE_DOT=False),
                            4,
                            DECODE_STAGES,
                            dt,
                            d,
                        )
                    )
            out.append(
                (
                    "paged_decode_attention",
                    "_reduce_splits_kernel",
                    {},
                    dict(SPLITS_PAD=MAX_SPLITS, HEAD_DIM=d, HAS_LSE=True),
                    4,
                    None,
                    dt,
                    d,
                )
            )
            # prefill (causal, output direct) and shared prefix (non-causal, split-KV into fp32 partials)
            block_m, block_n, warps = prefill_tile(d)
            for causal, o_type in ((True, dt), (False, "fp32")):
                out.append(
                    (
                        "paged_prefill_attention",
                        "_prefill_kernel",
                        {"o_ptr": "*" + o_type},
                        dict(
                            GROUP=4,
                            HEAD_DIM=d,
                            BLOCK_M=block_m,
                            BLOCK_N=block_n,
                            CAUSAL=causal,
                            HAS_LSE=True,
                            IEEE_DOT=False,
                        ),
                        warps,
                        PREFILL_STAGES,
                        dt,
                        d,
                    )
                )
        out.append(
            (
                "kv_pages",
                "_copy_pages_kernel",
                {},
                dict(PAGE_ELEMS=16 * 8 * 128, SRC_INDEXED=True, DST_INDEXED=False, BLOCK=4096),
                4,
                None,
                dt,
                128,
            )
        )
    return out


def _res_usage(cubin: bytes, tmp: Path) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = tmp / "k.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in fields.items()}


def _kv_buffers(ttgir: str) -> int:
    """Depth of the shared-memory buffers the K/V gathers are pipelined into (0: not pipelined)."""
    depths = [int(n) for n in re.findall(r"%[kv]_\d+ = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)]
    return min(depths) if len(depths) >= 2 and "async_copy_global_to_local" in ttgir else 0


def _compile_one(variant, tmp: Path) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel, ptr_types, constexprs, num_warps, num_stages, dt, d = variant
    fn = getattr(importlib.import_module(f"minisched.triton_kernels.{module}"), kernel)
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = ptr_types.get(name) or IDX.get(name) or F32.get(name) or "*" + dt
        elif name.endswith("scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        specialized = name not in fn.do_not_specialize and i not in fn.do_not_specialize
        if name.endswith("_ptr") or (name.startswith("stride") and specialized):  # as the launcher's specialization
            attrs[(i,)] = backend.parse_attr("D") if hasattr(backend, "parse_attr") else [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(src, target=target, options=options)
    usage = _res_usage(compiled.asm["cubin"], tmp)
    flags = ",".join(f"{k}={v}" for k, v in constexprs.items() if k in ("GROUP", "BLOCK_M", "CAUSAL"))
    flags += f",w{num_warps}" + ("" if num_stages is None else f",s{num_stages}")
    return dict(
        kernel=kernel,
        dtype=dt,
        head_dim=d,
        config=flags,
        regs=usage.get("reg"),
        stack=usage.get("stack", 0),
        local=usage.get("local", 0),
        shared=compiled.metadata.shared,
        kv_buffers=_kv_buffers(compiled.asm["ttgir"]),
    )


def _compile_in_tmp(variant) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return _compile_one(variant, Path(tmp))


def _compile_all() -> list:
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_compile_in_tmp, _variants()))


def _table(rows) -> str:
    lines = [
        f"{'kernel':24} {'dtype':5} {'D':>4} {'config':40} {'regs':>4} {'stack':>5} {'local':>5} {'smem':>6} "
        f"{'kvbuf':>5}"
    ]
    for r in rows:
        lines.append(
            f"{r['kernel']:24} {r['dtype']:5} {r['head_dim']:4} {r['config']:40} {r['regs']:4} "
            f"{r['stack']:5} {r['local']:5} {r['shared']:6} {r['kv_buffers']:5}"
        )
    return "\n".join(lines)


def test_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, __file__, "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\n" + _table(rows))
    assert len(rows) == len(_variants())
    spilled = [r for r in rows if r["stack"] or r["local"]]
    assert not spilled, "kernels spill:\n" + _table(spilled)
    # attention: the K/V gathers are cp.async'd into >= 2 shared buffers (loads overlap the MMAs)
    attention = [r for r in rows if r["kernel"] in ("_decode_split_kernel", "_prefill_kernel")]
    single = [r for r in attention if r["kv_buffers"] < 2]
    assert not single, "K/V not double-buffered in the TTGIR:\n" + _table(single)


# -- no recompiles in serving: the compiled variants do not depend on the batch ------------------


def _record_launches(monkeypatch, kernel) -> list:
    """Patch `kernel` (interpreted or jitted) to record its launches' (args, kwargs) without running them."""
    launches = []

    def record(*args, grid, warmup, **kwargs):
        launches.append((args, kwargs))

    monkeypatch.setattr(kernel, "run", record)
    return launches


def _cache_keys(kernel, launches) -> set:
    """Triton's own JIT cache keys (specialization + options, as JITFunction.run computes them) of the launches:
    one key = one compiled variant. Computed for an sm_90 target, so it needs no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    dns = getattr(kernel, "do_not_specialize", None)
    if dns is None:  # an InterpretedFunction keeps the decorator's arguments
        dns = kernel.kwargs.get("do_not_specialize")
    jitted = JITFunction(kernel.fn, do_not_specialize=dns)
    binder = create_function_from_signature(jitted.signature, jitted.params, make_backend(GPUTarget("cuda", 90, 32)))
    keys = set()
    for args, kwargs in launches:
        _, specialization, options = binder(*args, **kwargs)
        keys.add(compute_cache_key({}, specialization, options))
    return keys


def test_decode_variants_do_not_depend_on_batch(monkeypatch):
    """Batch 1..256 (and the split count 1..32 it implies) compiles one variant per kernel and output kind."""
    pytest.importorskip("triton")
    from minisched.triton_kernels import paged_decode_attention as dec
    from minisched.triton_kernels import store_kv as skv

    split_launches = _record_launches(monkeypatch, dec._decode_split_kernel)
    reduce_launches = _record_launches(monkeypatch, dec._reduce_splits_kernel)
    store_launches = _record_launches(monkeypatch, skv._store_kv_kernel)
    gen = torch.Generator().manual_seed(0)
    ps, hkv, hq, d, pool = 16, 8, 32, 128, 64
    k_cache = torch.zeros(pool, ps, hkv, d, dtype=torch.float16)
    for batch in range(1, 257):
        lens = torch.randint(1, 16385, (batch,), generator=gen)
        lens[0] = 16384  # batch 1 then takes the most splits (32)
        npages = (lens + ps - 1) // ps
        indptr = torch.zeros(batch + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(npages, 0)
        indices = torch.randint(0, pool, (int(indptr[-1]),), generator=gen, dtype=torch.int32)  # never read
        last = ((lens - 1) % ps + 1).to(torch.int32)
        q = torch.zeros(batch, hq, d, dtype=torch.float16)
        out, lse = torch.empty_like(q), torch.empty(batch, hq)
        dec.paged_decode_attention(q, k_cache, k_cache, indptr, indices, last, 0.1, out, lse)
        kv = torch.zeros(batch, hkv, d, dtype=torch.float16)
        skv.store_kv(kv, kv, k_cache, k_cache, torch.full((batch,), -1, dtype=torch.int32))
    splits = {args[dec._decode_split_kernel.arg_names.index("num_splits")] for args, _ in split_launches}
    # many split counts, 1 and a multiple of 16 among them (Triton would specialize an int arg on those)
    assert len(splits) >= 8 and 1 in splits and any(s % 16 == 0 for s in splits), sorted(splits)
    assert len(split_launches) == 256 and len(store_launches) == 256
    # one variant writes the output directly (1 split), one writes fp32 partials; one merge; one store
    assert len(_cache_keys(dec._decode_split_kernel, split_launches)) == 2
    assert len(_cache_keys(dec._reduce_splits_kernel, reduce_launches)) == 1
    assert len(_cache_keys(skv._store_kv_kernel, store_launches)) == 1


def test_prefill_variants_do_not_depend_on_batch(monkeypatch):
    """Ragged prefill batches of 1..64 requests (1..300 new tokens each): tile size and split count are not
    constexprs of the batch, so at most two variants (output direct / fp32 partials) and one merge."""
    pytest.importorskip("triton")
    from minisched.triton_kernels import paged_decode_attention as dec
    from minisched.triton_kernels import paged_prefill_attention as pre

    launches = _record_launches(monkeypatch, pre._prefill_kernel)
    reduce_launches = _record_launches(monkeypatch, dec._reduce_splits_kernel)
    gen = torch.Generator().manual_seed(1)
    ps, hkv, hq, d, pool = 16, 8, 32, 128, 64
    k_cache = torch.zeros(pool, ps, hkv, d, dtype=torch.float16)
    for batch in range(1, 65):
        qo = torch.randint(1, 301, (batch,), generator=gen)
        lens = qo + torch.randint(0, 2000, (batch,), generator=gen)
        npages = (lens + ps - 1) // ps
        indptr = torch.zeros(batch + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(npages, 0)
        qo_indptr = torch.zeros(batch + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(qo, 0)
        indices = torch.randint(0, pool, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
        last = ((lens - 1) % ps + 1).to(torch.int32)
        q = torch.zeros(int(qo.sum()), hq, d, dtype=torch.float16)
        out, lse = torch.empty_like(q), torch.empty(q.shape[0], hq)
        pre.paged_prefill_attention(q, qo_indptr, k_cache, k_cache, indptr, indices, last, True, 0.1, out, lse)
    assert len(launches) == 64
    assert len(_cache_keys(pre._prefill_kernel, launches)) <= 2
    assert len(_cache_keys(dec._reduce_splits_kernel, reduce_launches)) <= 1


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: wrap_triton cannot trace the interpreter's kernels"
)
def test_triton_ops_under_torch_compile():
    """The torch.library.triton_op registrations trace (fullgraph) and match eager."""
    import minisched.triton_kernels.merge_attention_states  # noqa: F401  (registers torch.ops.minisched_triton.*)
    import minisched.triton_kernels.paged_decode_attention  # noqa: F401
    import minisched.triton_kernels.paged_prefill_attention  # noqa: F401
    import minisched.triton_kernels.store_kv  # noqa: F401

    ops = torch.ops.minisched_triton
    dev, dt, ps, hkv, hq, d = "cuda", torch.bfloat16, 16, 2, 8, 64
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, ps, hkv, d, generator=gen).to(dev, dt)
    v_cache = torch.randn(6, ps, hkv, d, generator=gen).to(dev, dt)
    kv_indptr = torch.tensor([0, 2, 5], dtype=torch.int32, device=dev)
    kv_indices = torch.tensor([4, 0, 1, 5, 2], dtype=torch.int32, device=dev)
    last = torch.tensor([3, 16], dtype=torch.int32, device=dev)
    qo_indptr = torch.tensor([0, 3, 7], dtype=torch.int32, device=dev)
    q = torch.randn(7, hq, d, generator=gen).to(dev, dt)
    new_k = torch.randn(7, hkv, d, generator=gen).to(dev, dt)
    slots = torch.tensor([16, 17, 18, -1, 80, 81, 82], dtype=torch.int32, device=dev)

    def step(q, new_k, k_cache, v_cache):
        ops.store_kv(new_k, new_k, k_cache, v_cache, slots)
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
        ops.paged_prefill_attention(q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, last, True, 0.125, out, lse)
        dec, dec_lse = torch.empty_like(q[:2]), q.new_empty((2, hq), dtype=torch.float32)
        ops.paged_decode_attention(
            q[:2].contiguous(), k_cache, v_cache, kv_indptr, kv_indices, last, 0.125, dec, dec_lse
        )
        merged, merged_lse = torch.empty_like(dec), torch.empty_like(dec_lse)
        ops.merge_attention_states(dec, dec_lse, out[:2].contiguous(), lse[:2].contiguous(), merged, merged_lse)
        return out, lse, merged, merged_lse

    eager = step(q, new_k, k_cache.clone(), v_cache.clone())
    compiled = torch.compile(step, fullgraph=True)(q, new_k, k_cache.clone(), v_cache.clone())
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


if __name__ == "__main__":
    results = _compile_all()
    print(json.dumps(results) if "--json" in sys.argv else _table(results))
