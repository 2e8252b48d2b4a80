"""Hugging Face decoder checkpoints: their architecture (arch.py), the decoder (decoder.py: Llama,
Qwen2, Qwen3), loading weights (loader.py), the tokenizer and chat template (tokenizer.py), and
random-weight checkpoints for tests and benchmarks (make_model.py: `kvpush make-model`)."""
