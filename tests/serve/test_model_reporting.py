"""What the server says about the model it serves, for the families' tiny models (tests/helpers/families.py):
/v1/models (the name, the context length), /model_info (the family), /server_info (the context length and the
model's own chat template), and a chat completion rendered with that template ending at the model's stop token.

Mistral's sliding window (4096) caps its context below its 32768 positions: the limit the server reports and
enforces; Qwen3's 40960 positions are capped by the pool (16384 tokens by default on the CPU) instead.
"""

from __future__ import annotations

import httpx
import pytest

from helpers import families as F
from helpers.serve import running_server
from minisched.engine import Engine


@pytest.mark.parametrize(
    "name, arch, context", [("qwen3", "Qwen3ForCausalLM", 16384), ("mistral", "MistralForCausalLM", 4096)]
)
def test_the_server_reports_the_model(tmp_path, name, arch, context):
    fam = F.build(name, tmp_path)
    engine = Engine(fam.hf_dir, page_size=16)
    with running_server(engine, model_name=f"tiny-{name}") as live:
        models = httpx.get(live.v1 + "/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(f"tiny-{name}", context)]
        info = httpx.get(live.url + "/model_info", timeout=10).json()
        assert (info["model_type"], info["architectures"]) == (name, [arch])
        server = httpx.get(live.url + "/server_info", timeout=10).json()
        assert server["context_length"] == context and server["chat_template"] == fam.family.template
        body = {"model": f"tiny-{name}", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(live.v1 + "/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        prompt = fam.hf_tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)["input_ids"]
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)  # transformers' rendering of its template
