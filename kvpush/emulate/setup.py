"""What an emulated engine takes from the checkpoint and what from the profile.

MODEL supplies the tokenizer, the vocabulary and the end-of-sequence ids; the profile supplies the KV
geometry (layers, KV heads, head size, dtype), the longest context and the clock. No weight is loaded.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvpush.emulate.profile import Profile
from kvpush.emulate.runner import EmulatedRunner
from kvpush.engine.kv_cache import KVCache
from kvpush.models.arch import ArchConfig, load_arch_config
from kvpush.models.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def emulated_arch(model_dir: str, profile: Profile) -> tuple[ArchConfig, torch.dtype]:
    """The checkpoint's architecture with the profile's KV geometry and context length, and the KV dtype."""
    arch = load_arch_config(model_dir)
    kv = profile.kv
    arch = replace(arch, num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                   max_position_embeddings=profile.max_model_len)
    return arch, DTYPES[kv.dtype]


def emulated_runner(cache: KVCache, profile: Profile, time_scale: float, model_dir: str, vocab_size: int,
                    eos_ids: set[int], max_positions: int) -> EmulatedRunner:
    """The runner, choosing among the tokenizer's ordinary tokens (below `vocab_size`, none special or eos)."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    skip = tokenizer.special_token_ids() | eos_ids | tokenizer.eos_token_ids
    size = min(vocab_size, tokenizer.vocab_size)
    vocab = [t for t in range(size) if t not in skip]
    eos = min(eos_ids | tokenizer.eos_token_ids, default=None)
    return EmulatedRunner(cache, profile, time_scale, vocab, eos, vocab_size, max_positions)
