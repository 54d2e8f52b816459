"""One tiny case per CUDA kernel configuration, each run once, for compute-sanitizer to wrap -- not a test.

    compute-sanitizer --tool memcheck  python benchmarks/kernels/sanitize_cases.py
    compute-sanitizer --tool racecheck python benchmarks/kernels/sanitize_cases.py [--case decode_2x2,wgmma_d128]
    python benchmarks/kernels/sanitize_cases.py --list
    python benchmarks/kernels/sanitize_cases.py --device cpu      # the C++ kernels: checks the plumbing only

benchmarks/device_check.sh runs it under memcheck and racecheck (with PYTORCH_NO_CUDA_MEMORY_CACHING=1,
so that every tensor is its own allocation and an access past its end is not inside a neighbour's).
The inputs are built on the host and copied over, so the only kernels launched are minisched's and a
few of torch's (copies, empty/fill). How each configuration is selected (csrc/cuda/NOTES.md):

  decode     one 4-warp CTA shape per GQA group size: 1 x 4 warps (ROW_WARPS x KV_WARPS) for GQA <= 16,
             2 x 2 for <= 32, 4 x 1 above (several 64-row tiles per request); split-KV (the
             merge_splits kernel) when few requests have long contexts (choose_splits fills the SMs)
  prefill    64-row CTA, 1 m16 row fragment per warp, when the mean request has <= 64 query rows
             (num_qo * group <= 64 * batch), else the 128-row CTA with 2 row fragments per warp
  wgmma      paged_prefill_attention(..., cuda_kernel="wgmma"): sm_90 only, head_dim 64 or 128
  cascade    shared_prefix_attention (one group) + paged decode of the suffixes + merge_attention_states
  kv ops     store_kv (with skipped slots), copy/gather/scatter_kv_pages (device, and pinned host buffers)
  bad table  a page index past the pool: the request's rows become NaN and nothing out of range is read

Prints one line per case ("ok" or the error) after the case has synchronized, so a sanitizer report
printed before a case's line is that case's; exits 1 if any case raised. The sanitizer's own report (and
its --error-exitcode) says whether a kernel touched memory it should not have. A memory fault leaves the
CUDA context unusable, so the cases after it fail too: rerun the first one alone with --case.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from minisched import ops

CASES: dict = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


class Ctx:
    """Inputs are made on the host (seeded) and moved to the device: no torch RNG kernels under the sanitizer."""

    def __init__(self, device: str, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator().manual_seed(0)

    def randn(self, *shape, dtype=None):
        return torch.randn(shape, generator=self.gen).to(dtype or self.dtype).to(self.device)

    def i32(self, values):
        return torch.tensor(values, dtype=torch.int32).to(self.device)

    def paged(self, lens, hkv, d, page_size=16, extra_pages=3, more=()):
        """Random K/V pool and a CSR page table with each request's pages drawn at random from it; `more`:
        further lists of lengths, each given its own table in the same pool (no page shared)."""
        groups = [list(lens), *map(list, more)]
        need = [[-(-n // page_size) for n in g] for g in groups]
        num_pages = sum(map(sum, need)) + extra_pages
        perm = torch.randperm(num_pages, generator=self.gen).to(torch.int32)
        tables, used = [], 0
        for g, ng in zip(groups, need):
            indptr = [0]
            for n in ng:
                indptr.append(indptr[-1] + n)
            last = [(n - 1) % page_size + 1 if n else page_size for n in g]
            tables.append(
                (self.i32(indptr), perm[used : used + indptr[-1]].contiguous().to(self.device), self.i32(last))
            )
            used += indptr[-1]
        k = self.randn(num_pages, page_size, hkv, d)
        v = self.randn(num_pages, page_size, hkv, d)
        return (k, v, tables[0]) if not more else (k, v, *tables)


def sync(c: Ctx) -> None:
    if c.device == "cuda":
        torch.cuda.synchronize()


def finite(*ts) -> None:
    for t in ts:
        if not torch.isfinite(t).all():
            raise AssertionError("non-finite output")


def decode(c: Ctx, lens, hq, hkv, d):
    k, v, table = c.paged(lens, hkv, d)
    q = c.randn(len(lens), hq, d)
    out, lse = ops.paged_decode_attention(q, k, v, *table, return_lse=True)
    finite(out)


@case
def decode_1x4_d128(c):
    decode(c, [37, 100, 1], 8, 2, 128)  # GQA 4


@case
def decode_1x4_d64(c):
    decode(c, [37, 100, 1], 8, 2, 64)


@case
def decode_2x2_d128(c):
    decode(c, [37, 65, 5], 24, 1, 128)  # GQA 24


@case
def decode_4x1_d128(c):
    decode(c, [37, 70], 96, 1, 128)  # GQA 96: two 64-row tiles per request


@case
def decode_split_kv(c):
    decode(c, [1500, 700], 8, 8, 128)  # 2 requests x 8 kv heads: split-KV + merge_splits


def prefill(c: Ctx, qo_lens, kv_lens, hq, hkv, d, cuda_kernel="auto", causal=True):
    k, v, table = c.paged(kv_lens, hkv, d)
    qo = [0]
    for n in qo_lens:
        qo.append(qo[-1] + n)
    q = c.randn(qo[-1], hq, d)
    out, lse = ops.paged_prefill_attention(
        q, c.i32(qo), k, v, *table, causal=causal, return_lse=True, cuda_kernel=cuda_kernel
    )
    finite(out)


@case
def prefill_rf1_d128(c):
    prefill(c, [3, 5], [40, 70], 8, 2, 128)  # 32 rows for 2 requests: the 64-row CTA


@case
def prefill_rf2_d128(c):
    prefill(c, [70, 50], [100, 50], 8, 2, 128)  # 480 rows: the 128-row CTA, 2 fragments per warp


@case
def prefill_rf2_d64(c):
    prefill(c, [70, 50], [100, 50], 8, 2, 64, causal=False)


@case
def prefill_rf2_split_kv(c):
    prefill(c, [20], [3000], 32, 4, 128)  # a short extend on a long prefix: split-KV over 128-row tiles


def wgmma(c: Ctx, d):
    if c.device != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        return "skipped (needs an sm_90 GPU)"
    prefill(c, [70, 30], [150, 30], 8, 2, d, cuda_kernel="wgmma")
    return None


@case
def wgmma_d64(c):
    return wgmma(c, 64)


@case
def wgmma_d128(c):
    return wgmma(c, 128)


@case
def cascade(c):
    hq, hkv, d, ps = 8, 2, 128, 16
    suffix_lens = [5, 0, 17, 3]  # one request with no own pages: an empty KV range
    k, v, pre, suf = c.paged([100], hkv, d, page_size=ps, more=[suffix_lens])
    q = c.randn(len(suffix_lens), hq, d)
    out = ops.cascade_decode_attention(q, c.i32([0, len(suffix_lens)]), k, v, pre, suf)
    finite(out)


@case
def merge_states(c):
    va, vb = c.randn(37, 8, 128), c.randn(37, 8, 128)
    la, lb = c.randn(37, 8, dtype=torch.float32), c.randn(37, 8, dtype=torch.float32)
    lb[3] = float("-inf")  # one side empty
    out, lse = ops.merge_attention_states(va, la, vb, lb)
    finite(out)


@case
def store_kv(c):
    hkv, d, ps, pages = 2, 128, 16, 6
    kc, vc = c.randn(pages, ps, hkv, d), c.randn(pages, ps, hkv, d)
    slots = torch.randperm(pages * ps, generator=c.gen)[:33].to(torch.int32)
    slots[[0, 7, 32]] = -1  # skipped
    ops.store_kv(c.randn(33, hkv, d), c.randn(33, hkv, d), kc, vc, slots.to(c.device))


def pool(c: Ctx):
    return c.randn(3, 2, 12, 16, 2, 64)  # layers x K/V x pages x page_size x heads x head_dim


@case
def copy_kv_pages(c):
    kv = pool(c)
    ops.copy_kv_pages(kv, c.i32([0, 5, 7]), c.i32([1, 9, 11]))


@case
def gather_scatter_kv_pages(c):
    kv = pool(c)
    pages = c.i32([4, 0, 11])
    buf = ops.gather_kv_pages(kv, pages)
    ops.scatter_kv_pages(buf, kv, c.i32([2, 3, 6]))


@case
def gather_scatter_kv_pages_pinned(c):
    if c.device != "cuda":
        return "skipped (pinned host buffers need CUDA)"
    kv = pool(c)
    host = torch.empty((3, 2, 3, 16, 2, 64), dtype=c.dtype, pin_memory=True)
    ops.gather_kv_pages(kv, c.i32([4, 0, 11]), host)
    sync(c)
    ops.scatter_kv_pages(host, kv, c.i32([2, 3, 6]))
    return None


def rejected(fn) -> str:
    """The C++ CPU kernels check index values on the host (CUDA ones cannot without a sync): an IndexError."""
    try:
        fn()
    except IndexError:
        return "ok (IndexError on the host, as the CPU kernels do)"
    raise AssertionError("a bad page table was not rejected on the CPU")


@case
def decode_bad_page_table(c):
    k, v, (indptr, indices, last) = c.paged([40, 33], 2, 128)
    indices = indices.clone()
    indices[0] = k.shape[0] + 1000  # request 0 points past the pool
    q = c.randn(2, 8, 128)
    if c.device != "cuda":
        return rejected(lambda: ops.paged_decode_attention(q, k, v, indptr, indices, last, check=False))
    out = ops.paged_decode_attention(q, k, v, indptr, indices, last, check=False)
    if not (torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()):
        raise AssertionError("a bad page should give NaN rows for its request only")
    return None


@case
def prefill_bad_page_table(c):
    k, v, (indptr, indices, last) = c.paged([100, 50], 2, 128)
    indices = indices.clone()
    indices[-1] = -5  # request 1's last page
    q = c.randn(120, 8, 128)
    run = lambda: ops.paged_prefill_attention(q, c.i32([0, 70, 120]), k, v, indptr, indices, last, check=False)
    if c.device != "cuda":
        return rejected(run)
    out = run()
    if not (torch.isnan(out[70:]).all() and torch.isfinite(out[:70]).all()):
        raise AssertionError("a bad page should give NaN rows for its request only")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="", help="comma list of case names (default: all; --list shows them)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    names = [n for n in args.case.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; --list shows them")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sanitize_cases: no CUDA device (use --device cpu for the plumbing check)", file=sys.stderr)
        return 2
    if not ops.native_available():
        print(f"sanitize_cases: the native extension is not built: {ops.NATIVE_ERROR}", file=sys.stderr)
        return 2
    # the CPU kernels run float32 (this mode checks the driver, not the CUDA kernels)
    c = Ctx(args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    failed = 0
    for name in names:
        t0 = time.perf_counter()
        try:
            note = CASES[name](c)
            sync(c)
            print(f"case {name}: {note or 'ok'} ({time.perf_counter() - t0:.2f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every case, not the first failure
            failed += 1
            print(
                f"case {name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True
            )
    print(f"sanitize_cases: {len(names) - failed} of {len(names)} cases ran", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
