"""SGLang 0.5.23's scheduling decisions on the CPU, without a model: the harness's reference side.

SGLang's `Scheduler` needs a model worker, so `SGLangReplica` owns the step loop and drives SGLang's
own pieces the way `Scheduler.get_next_batch_to_run`, `_get_new_batch_prefill_raw` and
`update_running_batch` do (managers/scheduler.py): `SchedulePolicy.calc_priority`,
`PrefillAdder.add_chunked_req` / `add_one_req`, `ScheduleBatch.init_new` + `prepare_for_extend`
(which allocates through SGLang's `alloc_for_extend`), `check_decode_mem`, `retract_decode`,
`prepare_for_decode`, `RadixCache` and the token / paged allocators, and the prefill / decode result
handling of `batch_result_processor.py` (output append, `update_finish_state`, `release_kv_cache`,
`checkpoint_kv_cache`). Left out (off by default in SGLang): mixed chunks, overlap, priority
scheduling, LoRA, hierarchical cache, speculative decoding.

Made deterministic for the comparison: `RadixCache` stamps LRU with `time.monotonic()`, so the tree's
module sees a logical clock that ticks once per call.

Runs only under the SGLang environment (`make sglang-env`); imports take ~20 s.
"""

from __future__ import annotations

import itertools
import logging
from array import array

import torch
from sched_decision import Decision
from sglang.srt import runtime_context
from sglang.srt.server_args import ServerArgs

runtime_context.publish(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")

import sglang.srt.mem_cache.radix_cache as _radix  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy  # noqa: E402
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

logging.getLogger("sglang").setLevel(logging.ERROR)  # retract_decode warns on every retraction


class _LogicalTime:
    """`time` as the radix cache sees it: monotonic() ticks once per call, so LRU ties are deterministic."""

    def __init__(self, real) -> None:
        self._real, self._tick = real, itertools.count(1)

    def monotonic(self) -> float:
        return float(next(self._tick))

    def __getattr__(self, name):
        return getattr(self._real, name)


if not isinstance(_radix.time, _LogicalTime):
    _radix.time = _LogicalTime(_radix.time)


class _ModelConfig:
    """What ScheduleBatch reads of a model's config: a decoder-only model with a small vocabulary."""

    vocab_size = 1024
    is_encoder_decoder = False

    class hf_text_config:  # noqa: N801 (an attribute bag)
        pass


class CPUBatch(ScheduleBatch):
    """`filter_batch` keeps only `reqs`: the forward tensors it also slices exist only after a model's
    `prepare_for_extend` outputs; which requests stay (the decision) is unchanged."""

    def filter_batch(self, reqs_to_exclude=None, keep_indices=None):
        if keep_indices is None:
            if isinstance(reqs_to_exclude, Req):
                reqs_to_exclude = [reqs_to_exclude]
            exclude = reqs_to_exclude or []
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished() and r not in exclude]
        self.reqs = [self.reqs[i] for i in keep_indices]

    def sync_rows(self) -> None:
        """The per-row tensors `prepare_for_decode` reads (`alloc_for_decode` sizes its allocation by
        `seq_lens`), rebuilt from `reqs`: SGLang's `filter_batch` / `merge_batch` keep them in step, the
        `reqs`-only filter and merge here do not."""
        lens = [r.kv.kv_committed_len for r in self.reqs]
        assert lens == [len(r.origin_input_ids) + len(r.output_ids) - 1 for r in self.reqs], "decode rows out of step"
        self.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
        self.seq_lens = self.seq_lens_cpu.clone()
        self.orig_seq_lens = self.seq_lens.to(torch.int32)
        self.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx for r in self.reqs], dtype=torch.int64)
        self.req_pool_indices = self.req_pool_indices_cpu.clone()


class SGLangReplica:
    def __init__(
        self,
        *,
        policy: str,
        page_size: int,
        pool_tokens: int,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunk_size: int | None,
        context_len: int,
        next_token,
    ) -> None:
        self.page_size, self.next_token = page_size, next_token
        self.max_prefill_tokens, self.chunk_size = max_prefill_tokens, chunk_size
        if page_size == 1:
            self.alloc = TokenToKVPoolAllocator(pool_tokens, torch.float16, "cpu", None, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(pool_tokens, page_size, torch.float16, "cpu", None, False)
        self.r2t = ReqToTokenPool(max_running_requests, context_len + 8, "cpu", False)
        self.tree = RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, page_size=page_size
            )
        )
        self.policy = SchedulePolicy(policy, self.tree, False, False, False)
        self.ratio = NewTokenRatioTracker.from_config()
        self.waiting: list[Req] = []
        self.running = self._batch([])
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.reqs: dict[str, Req] = {}

    def _batch(self, reqs: list[Req]) -> CPUBatch:
        return CPUBatch(
            reqs=reqs,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.alloc,
            tree_cache=self.tree,
            device="cpu",
        )

    # -- requests -------------------------------------------------------------
    def add_request(self, rid: str, prompt: list[int], max_new_tokens: int) -> None:
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=max_new_tokens))
        req.sampling_params.normalize(None)
        self.reqs[rid] = req
        self.waiting.append(req)

    def abort_waiting(self, rid: str) -> None:
        """An abort of a queued request (scheduler.py abort_request: it leaves the waiting queue)."""
        req = self.reqs.pop(rid)
        self.waiting.remove(req)

    def is_waiting(self, rid: str) -> bool:
        req = self.reqs.get(rid)
        return req is not None and any(r is req for r in self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting) or not self.running.is_empty() or self.chunked_req is not None

    def cached_tokens(self) -> int:
        return int(self.tree.total_size())

    # -- one step -------------------------------------------------------------
    def step(self) -> Decision:
        retracted: list[str] = []
        # get_next_batch_to_run: the last extend's requests join the running batch
        excl = []
        if self.chunked_req is not None:
            excl.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                checkpoint_kv_cache(self.chunked_req, self.tree)  # stash_chunked_request
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            if last.chunked_req is not None:
                excl.append(last.chunked_req)
            last_bs = len(last.reqs)
            last.filter_batch(reqs_to_exclude=excl)
            if len(last.reqs) < last_bs:
                self.running.batch_is_full = False
            if not last.is_empty():
                if self.running.is_empty():
                    self.running = last
                else:
                    self.running.reqs = self.running.reqs + last.reqs  # merge_batch keeps batch_is_full
        running_bs = len(self.running.reqs)
        self.running.filter_batch()
        if len(self.running.reqs) < running_bs:
            self.running.batch_is_full = False
        batch = self._prefill()
        if batch is None and not self.running.is_empty():
            batch = self._decode(retracted)
        self.last_batch = batch
        if batch is None:
            return Decision("idle", [], None, retracted, self.ratio.current, self.cached_tokens(), [])
        mode = "prefill" if batch.forward_mode.is_extend() else "decode"
        if mode == "prefill":
            rows = [(r.rid, int(r.prefix_len), int(r.extend_len)) for r in batch.reqs]
        else:  # a decode row computes its last token (req.prefix_len is the last prefill's)
            rows = [(r.rid, len(r.origin_input_ids) + len(r.output_ids) - 1, 1) for r in batch.reqs]
        ratio, cached = self.ratio.current, self.cached_tokens()
        finished = self._process(batch, mode)
        return Decision(
            mode, rows, None if self.chunked_req is None else self.chunked_req.rid, retracted, ratio, cached, finished
        )

    def _prefill(self) -> ScheduleBatch | None:
        running = self.running
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        if self.r2t.available_size() <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting, running)
        adder = PrefillAdder(
            self.page_size,
            self.tree,
            self.alloc,
            running,
            self.ratio.current,
            self.max_prefill_tokens,
            self.chunk_size,
            0,
            0,
            max_running_requests=self.r2t.size,
            waiting_queue_len=len(self.waiting),
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                self.chunked_req, self.waiting, adder.rem_chunk_tokens or 0, self.page_size
            )
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self.r2t.available_size() + held:
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        can_run = adder.can_run_list
        del running_bs
        if not can_run:
            return None
        self.waiting = [x for x in self.waiting if x not in set(can_run)]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = CPUBatch.init_new(
            can_run,
            self.r2t,
            self.alloc,
            self.tree,
            _ModelConfig(),
            False,
            SpeculativeAlgorithm.NONE,
            chunked_req=self.chunked_req,
        )
        batch.device = "cpu"
        batch.prepare_for_extend()
        return batch

    def _decode(self, retracted: list[str]) -> ScheduleBatch | None:
        batch = self.running
        initial_bs = len(batch.reqs)
        if not batch.check_decode_mem():
            reqs, ratio, aborted = batch.retract_decode()
            self.ratio.current = ratio
            for req in reqs:
                retracted.append(req.rid)
                self.waiting.append(req)  # _add_request_to_queue(req, is_retracted=True)
            for req in aborted:
                retracted.append(req.rid)
                self.reqs.pop(req.rid, None)
        else:
            self.ratio.decay_step()
        if len(batch.reqs) < initial_bs:
            batch.batch_is_full = False
        if batch.is_empty():
            return None
        batch.sync_rows()
        batch.prepare_for_decode()
        return batch

    def _process(self, batch: ScheduleBatch, mode: str) -> list[str]:
        done = []
        for req in batch.reqs:
            if req.finished() or req.is_retracted:
                continue
            if mode == "prefill" and req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(self.next_token(list(req.origin_input_ids) + list(req.output_ids)))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree, checkpoint=True)
                done.append(req.rid)
                self.reqs.pop(req.rid, None)
            elif mode == "prefill":
                checkpoint_kv_cache(req, self.tree)
        return done
