"""Shared fixtures: tiny checkpoints made once per session, servers on free loopback ports."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("KVPUSH_TORCH_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from kvpush.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("models") / "tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory) -> str:
    """A random Llama checkpoint written by transformers itself (untied, llama3 rope scaling)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # spread the logits so greedy decoding has no near-ties
        model.lm_head.weight.normal_(0, 0.5)
    path = str(tmp_path_factory.mktemp("models") / "llama")
    model.save_pretrained(path)
    return path
