"""Shared test code (tests/ is on sys.path through tests/conftest.py): import it as `helpers.<module>`;
test modules never import each other or a conftest.py (tests/test_layers.py checks it).

targets / paged_kv: the op tests' backend x device x dtype targets, tensor helpers and paged K/V caches;
cuda_emulation: the numpy building blocks of the CUDA kernel emulations; model: paged forwards of a model;
families: tiny Qwen2 / Qwen3 / Mistral / Llama-3 models built with transformers, as HF folders and GGUF files;
engines / fake_runner / scheduler_machine / lifecycle_scenario: engines on a tiny model, the scheduler's
fake runner, its hypothesis machine and a recorded run; serve: a live test server.
"""
