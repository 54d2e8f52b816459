"""The native CPU path under torch.compile(fullgraph=True): a decode step of the model (the tiny
random-weights Llama, backend "native": store_kv, paged_decode_attention, packed_linear and rms_norm
through their fakes) compiles into one graph and gives eager's logits and KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.engines import tiny_model
from minisched import ops
from minisched.base.page_table import build_csr, slots_of
from minisched.model.llama import ForwardMeta

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="the native extension is not built")


def meta(pages, starts, ends, page_size, decode):
    qo = np.concatenate([[0], np.cumsum([e - a for a, e in zip(starts, ends)])]).astype(np.int32)
    return ForwardMeta(
        positions=torch.cat([torch.arange(a, e) for a, e in zip(starts, ends)]),
        out_slots=torch.from_numpy(
            np.concatenate([slots_of(p, a, e, page_size) for p, a, e in zip(pages, starts, ends)])
        ),
        qo_indptr=torch.from_numpy(qo),
        page_table=tuple(torch.from_numpy(a) for a in build_csr(pages, ends, page_size)),
        logits_indices=torch.arange(int(qo[-1])),
        is_decode=decode,
    )


def test_decode_step_compiles_to_one_graph_equal_to_eager(gen):
    model, page_size = tiny_model(), 4
    lens = [5, 9, 12]  # the prompts; the decode step adds one token to each
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in lens]
    pages, at = [], 0
    for n in lens:
        k = -(-(n + 1) // page_size)
        pages.append(list(range(at, at + k))[::-1])  # pages out of order
        at += k
    kv = model.new_kv_cache(at + 1, page_size)
    model(torch.cat(prompts), meta(pages, [0] * 3, lens, page_size, False), kv, backend="native")

    step = meta(pages, lens, [n + 1 for n in lens], page_size, True)
    ids = torch.randint(0, model.cfg.vocab_size, (3,), generator=gen)
    kv_eager, kv_compiled = kv.clone(), kv.clone()
    eager = model(ids, step, kv_eager, backend="native")
    torch._dynamo.reset()
    # backend "eager": dynamo traces the whole forward (the ops through their fakes, on FakeTensors) and
    # runs the one graph. aot_eager / inductor stop earlier, in AOT autograd: the model's buffers are
    # inference tensors ("Cannot set version_counter for inference tensor", model/llama.py rope_cos_sin).
    compiled_forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    compiled = compiled_forward(ids, step, kv_compiled, backend="native")
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(kv_compiled, kv_eager, rtol=0, atol=0)
    assert not torch.equal(kv_eager, kv)  # the step wrote its tokens' K/V
