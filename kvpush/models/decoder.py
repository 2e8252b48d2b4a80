"""Llama-family decoder (Llama, Qwen2, Qwen3) over the paged KV cache.

Projections are fused at load time (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`); the
loader maps Hugging Face tensor names onto them. Qwen3 adds per-head RMSNorm on q and k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvpush.kv_cache import KVCache
from kvpush.layers.attention import AttentionMetadata, paged_attention
from kvpush.layers.norm import RMSNorm
from kvpush.layers.rotary import RotaryEmbedding
from kvpush.models.arch import ArchConfig


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata, cache: KVCache):
        t = x.shape[0]  # x: [T, hidden]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, hd]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, kvh, hd]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = paged_attention(q, k, v, self.layer, meta, cache, self.scale)  # [T, H, hd]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, meta, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, meta: AttentionMetadata, cache: KVCache,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """layer_hook(l) runs right after layer l wrote its K/V to the cache (layer-wise push)."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rotary, meta, cache)
            if layer_hook is not None:
                layer_hook(i)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata, cache: KVCache, logit_rows: torch.Tensor,
                layer_hook: Callable[[int], None] | None = None):
        """input_ids, positions: [T]; logit_rows: [S] rows whose logits are wanted -> [S, vocab] fp32."""
        hidden = self.model(input_ids, positions, meta, cache, layer_hook)
        return self.lm_head(hidden[logit_rows]).float()
