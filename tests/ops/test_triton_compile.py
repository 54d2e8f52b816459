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
IDX = {name: "*i32" for name in ("slot_ptr", "src_pages_ptr", "dst_pages_ptr", "kv_indptr_ptr", "kv_indices_ptr",
                                 "kv_last_ptr", "qo_indptr_ptr", "tile_req_ptr", "tile_first_ptr")}
F32 = {name: "*fp32" for name in ("la_ptr", "lb_ptr", "lo_ptr", "lse_ptr", "po_ptr", "plse_ptr")}


def _variants():
    out = []
    for dt in ("bf16", "fp16"):
        for d in (128, 64):
            out.append(("store_kv", "_store_kv_kernel", {},
                        dict(HEAD_DIM=d, BLOCK_T=2048 // (8 * d), BLOCK_H=8, BLOCK_D=d), 4, dt, d))
            out.append(("merge_attention_states", "_merge_kernel", {},
                        dict(HEAD_DIM=d, BLOCK_H=2048 // d, BLOCK_D=d), 4, dt, d))
            # decode: group 8 (tl.dot, 16 rows), group 1 and group 3 (elementwise); split partials are fp32
            # (one split writes the output directly: compiled for the tl.dot path only, to save time)
            decode_shapes = ((8, 16, 64, True), (1, 1, 64, False), (3, 4, max(16, 8192 // (4 * d)), False))
            for group, pad, block_n, dot in decode_shapes:
                for splits, o_type in ((1, dt), (8, "fp32")) if dot else ((8, "fp32"),):
                    out.append(("paged_decode_attention", "_decode_split_kernel", {"o_ptr": "*" + o_type},
                                dict(GROUP=group, GROUP_PAD=pad, HEAD_DIM=d, BLOCK_N=block_n, NUM_SPLITS=splits,
                                     USE_DOT=dot, HAS_LSE=True, IEEE_DOT=False), 4, dt, d))
            out.append(("paged_decode_attention", "_reduce_splits_kernel", {},
                        dict(NUM_SPLITS=8, SPLITS_PAD=8, HEAD_DIM=d, HAS_LSE=True), 4, dt, d))
            # prefill (causal) and shared prefix (non-causal, split-KV into fp32 partials)
            for causal, splits, o_type in ((True, 1, dt), (False, 4, "fp32")):
                out.append(("paged_prefill_attention", "_prefill_kernel", {"o_ptr": "*" + o_type},
                            dict(GROUP=4, HEAD_DIM=d, BLOCK_M=64, BLOCK_N=64, NUM_SPLITS=splits, CAUSAL=causal,
                                 HAS_LSE=True, IEEE_DOT=False), 8 if d > 64 else 4, dt, d))
        out.append(("kv_pages", "_copy_pages_kernel", {},
                    dict(PAGE_ELEMS=16 * 8 * 128, SRC_INDEXED=True, DST_INDEXED=False, BLOCK=4096), 4, dt, 128))
    return out


def _res_usage(cubin: bytes, tmp: Path) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = tmp / "k.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in fields.items()}


def _compile_one(variant, tmp: Path) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel, ptr_types, constexprs, num_warps, dt, d = variant
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
        if name.endswith("_ptr") or name.startswith("stride"):  # as the launcher's runtime specialization
            attrs[(i,)] = backend.parse_attr("D") if hasattr(backend, "parse_attr") else [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(src, target=target, options={"num_warps": num_warps})
    usage = _res_usage(compiled.asm["cubin"], tmp)
    flags = ",".join(f"{k}={v}" for k, v in constexprs.items() if k in ("GROUP", "NUM_SPLITS", "CAUSAL", "USE_DOT"))
    return dict(kernel=kernel, dtype=dt, head_dim=d, config=flags, regs=usage.get("reg"),
                stack=usage.get("stack", 0), local=usage.get("local", 0), shared=usage.get("shared", 0))


def _compile_in_tmp(variant) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return _compile_one(variant, Path(tmp))


def _compile_all() -> list:
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_compile_in_tmp, _variants()))


def _table(rows) -> str:
    lines = [f"{'kernel':24} {'dtype':5} {'D':>4} {'config':38} {'regs':>4} {'stack':>5} {'local':>5} {'smem':>6}"]
    for r in rows:
        lines.append(f"{r['kernel']:24} {r['dtype']:5} {r['head_dim']:4} {r['config']:38} {r['regs']:4} "
                     f"{r['stack']:5} {r['local']:5} {r['shared']:6}")
    return "\n".join(lines)


def test_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__, "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\n" + _table(rows))
    assert len(rows) == len(_variants())
    spilled = [r for r in rows if r["stack"] or r["local"]]
    assert not spilled, "kernels spill:\n" + _table(spilled)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU: wrap_triton cannot trace the interpreter's kernels")
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
        ops.paged_prefill_attention(q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, last, True, 0.125,
                                    out, lse)
        dec, dec_lse = torch.empty_like(q[:2]), q.new_empty((2, hq), dtype=torch.float32)
        ops.paged_decode_attention(q[:2].contiguous(), k_cache, v_cache, kv_indptr, kv_indices, last, 0.125,
                                   dec, dec_lse)
        merged, merged_lse = torch.empty_like(dec), torch.empty_like(dec_lse)
        ops.merge_attention_states(dec, dec_lse, out[:2].contiguous(), lse[:2].contiguous(), merged, merged_lse)
        return out, lse, merged, merged_lse

    eager = step(q, new_k, k_cache.clone(), v_cache.clone())
    compiled = torch.compile(step, fullgraph=True)(q, new_k, k_cache.clone(), v_cache.clone())
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    results = _compile_all()
    print(json.dumps(results) if "--json" in sys.argv else _table(results))
