"""CUDA graphs for decode (minisched/engine/cuda_graph.py).

On the CPU: bucketing, and the padding that makes a decode batch fit a captured bucket -- the
padded batch run through the real model on the torch and C++ backends gives the real rows the
same logits and writes the same K/V, and the padding rows touch only the scratch page. On a GPU
(skipped here): capture and replay against eager decoding, token for token.
"""

from __future__ import annotations

import pytest
import torch

from helpers.engines import prompts  # noqa: E402
from helpers.engines import reference as _reference
from minisched import ops
from minisched.engine import Engine
from minisched.engine.cuda_graph import CudaGraphRunner, buckets_for, pad_decode, pick_bucket
from minisched.model import weights
from minisched.model.config import preset
from minisched.model.llama import LlamaModel
from minisched.model.tokenizer import MiniTokenizer
from minisched.sched.batch import ForwardMode
from minisched.sched.sampling_params import SamplingParams


def reference(model, prompt, n=8):
    return _reference(model, prompt, n)


BACKENDS = [
    pytest.param("torch"),
    pytest.param("native", marks=pytest.mark.skipif(not ops.native_available(), reason="extension not built")),
]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    cfg, state = weights.dummy_weights(preset("tiny"), seed=0)
    return LlamaModel.from_state_dict(cfg, state)


def test_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(6) == [1, 2, 4, 6]
    assert buckets_for(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets_for(30) == [1, 2, 4, 8, 16, 24, 30]
    b = buckets_for(64)
    assert [pick_bucket(b, n) for n in (1, 3, 8, 9, 63, 64, 65)] == [1, 4, 8, 16, 64, 64, None]
    with pytest.raises(ValueError, match="max_batch"):
        buckets_for(0)


def decode_step(model: LlamaModel, backend: str, page_size: int, lengths):
    """A live decode batch of the tiny model: (engine, batch, input ids, meta)."""
    engine = Engine(
        model,
        tokenizer=MiniTokenizer.byte_level(model.cfg.vocab_size),
        backend=backend,
        page_size=page_size,
        num_pages=256 // page_size,
    )
    for p in prompts(lengths, seed=11):
        engine.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()  # the prefill
    batch = engine.scheduler.get_next_batch()
    assert batch.mode is ForwardMode.DECODE
    ids, meta = engine.runner.build_meta(batch)
    return engine, batch, ids, meta


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bucket_extra", [0, 5])
def test_padding_rows_do_not_change_real_rows(tiny, backend, page_size, bucket_extra):
    engine, batch, ids, meta = decode_step(tiny, backend, page_size, [3, 17, 9])
    b = ids.shape[0]
    kv = engine.kv_cache
    scratch = kv.shape[2]  # one page past the pool, as the Engine adds it under CUDA graphs
    kv_ref = torch.cat([kv, kv.new_zeros(*kv.shape[:2], 1, *kv.shape[3:])], dim=2)
    kv_pad = kv_ref.clone()
    logits = tiny(ids, meta, kv_ref, backend=backend, check=True)
    pids, pmeta = pad_decode(ids, meta, b + bucket_extra, scratch, page_size)
    assert pids.shape[0] == pmeta.positions.shape[0] == b + bucket_extra and pmeta.is_decode
    padded = tiny(pids, pmeta, kv_pad, backend=backend, check=True)  # check=True: a valid page table
    torch.testing.assert_close(padded[:b], logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded[:b].argmax(-1), logits.argmax(-1))
    # real pages: the same K/V (up to the rounding of a matmul with more rows)
    torch.testing.assert_close(kv_pad[:, :, :scratch], kv_ref[:, :, :scratch], rtol=1e-5, atol=1e-5)
    assert torch.equal(kv_pad[:, :, :scratch] == 0, kv_ref[:, :, :scratch] == 0)  # no slot written by padding
    if bucket_extra:
        assert kv_pad[:, :, scratch].abs().sum() > 0  # the padding wrote only its scratch page
    engine.scheduler.process_batch_result(batch, [0] * b)


def test_pad_decode_errors_and_identity(tiny):
    _, _, ids, meta = decode_step(tiny, "torch", 4, [5, 6])
    same_ids, same = pad_decode(ids, meta, 2, 99, 4)
    assert same_ids is ids and torch.equal(same.page_table[0], meta.page_table[0])
    with pytest.raises(ValueError, match="does not fit bucket 1"):
        pad_decode(ids, meta, 1, 99, 4)


def test_cuda_graph_argument_checks(tiny):
    tok = MiniTokenizer.byte_level(tiny.cfg.vocab_size)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(tiny, tokenizer=tok, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph must be"):
        Engine(tiny, tokenizer=tok, cuda_graph="on")
    assert Engine(tiny, tokenizer=tok).cuda_graph is False  # the CPU default
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphRunner(
            tiny, torch.zeros(1, 2, 3, 4, 1, 64), 4, max_batch=4, max_context_len=64, scratch_page=2, backend="native"
        )


@GPU
@pytest.mark.parametrize("backend", ["native", "triton"])
def test_graph_replay_matches_eager_on_gpu(backend):
    """Decode steps replayed; 4 and 8 requests fill a bucket (the same kernels as eager: the same tokens),
    3 and 5 are padded (a GEMM of more rows may round differently in bf16: the first tokens agree)."""
    cfg, state = weights.dummy_weights(preset("tiny"), seed=0)
    model = LlamaModel.from_state_dict(cfg, state, dtype=torch.bfloat16, device="cuda")
    ps = prompts([3, 17, 9, 30, 1, 22, 5, 11], seed=12)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = {}
    for graph in (False, True):
        engine = Engine(
            model,
            tokenizer=MiniTokenizer.byte_level(cfg.vocab_size),
            device="cuda",
            backend=backend,
            page_size=16,
            num_pages=64,
            max_running_requests=8,
            cuda_graph=graph,
        )
        outs[graph] = {n: [o.token_ids for o in engine.generate(ps[:n], sp)] for n in (3, 4, 5, 8)}
        if graph:
            assert engine.runner.cuda_graphs.num_replays > 0
            assert sorted(engine.runner.cuda_graphs.graphs) == [1, 2, 4, 8]
    for n in (4, 8):
        assert outs[True][n] == outs[False][n]
    for n in (3, 5):
        assert [t[:2] for t in outs[True][n]] == [t[:2] for t in outs[False][n]]
