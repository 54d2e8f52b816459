"""The model layer: a Llama-family model over minisched.ops, its config, weights (GGUF,
safetensors, dummy), tokenizer and batched sampling."""
