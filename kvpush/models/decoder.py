"""Llama-family decoder (Llama, Qwen2, Qwen3) over the paged KV cache.

Projections are fused at load time (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`); the
loader maps Hugging Face tensor names onto them. Qwen3 adds per-head RMSNorm on q and k.

A layer runs as three pieces: `attention_input` (norm, q/k/v projection, q/k norm, rotary),
`paged_attention` (writes K/V to the cache, attends over it) and `attention_output` (o_proj, MLP,
residuals). The two dense pieces are pure functions of their tensors, so a compiler can turn each
into one graph shared by every layer (`CausalLM.compiled_pieces`, used for batches of at least
`compiled_min_tokens` tokens); attention and the per-layer hook stay eager between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvpush.kv_cache import KVCache
from kvpush.layers.attention import AttentionMetadata, paged_attention
from kvpush.layers.linear import Linear
from kvpush.layers.norm import RMSNorm
from kvpush.layers.rotary import RotaryEmbedding, apply_rotary
from kvpush.models.arch import ArchConfig


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def attention_input(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x: [T, hidden], cos, sin: [T, 1, hd] -> q [T, H, hd], k [T, kvh, hd], v [T, kvh, hd] (rotated)."""
    attn, t = layer.self_attn, x.shape[0]
    q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(t, attn.num_heads, attn.head_dim)
    k = k.view(t, attn.num_kv_heads, attn.head_dim)
    v = v.view(t, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v


def attention_output(layer: DecoderLayer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """x: [T, hidden] the layer's input, o: [T, H, hd] attention output -> the layer's output [T, hidden]."""
    x = x + layer.self_attn.o_proj(o.reshape(x.shape[0], -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


@dataclass
class Pieces:
    """The dense pieces a forward calls: plain functions, or compiled versions of them."""

    attention_input: Callable[..., Any] = attention_input
    attention_output: Callable[..., Any] = attention_output


class DecoderModel(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)


class CausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.pieces = Pieces()
        self.compiled_pieces: Pieces | None = None
        self.compiled_min_tokens = 0

    def pieces_for(self, num_tokens: int) -> Pieces:
        """Compiled pieces for batches of at least compiled_min_tokens tokens (if compiled), else eager."""
        if self.compiled_pieces is not None and num_tokens >= self.compiled_min_tokens:
            return self.compiled_pieces
        return self.pieces

    def forward(self, input_ids, positions, meta: AttentionMetadata, cache: KVCache, logit_rows: torch.Tensor,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; logit_rows: [S] rows whose logits are wanted -> [S, vocab] fp32.

        layer_hook(l) runs right after layer l wrote its K/V to the cache (layer-wise push).
        """
        m, pieces = self.model, self.pieces_for(input_ids.shape[0])
        x = m.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = m.rotary.cos_sin(positions, x.dtype)  # [T, 1, hd]
        for layer in cast(list[DecoderLayer], m.layers):
            q, k, v = pieces.attention_input(layer, x, cos, sin)
            o = paged_attention(q, k, v, layer.layer, meta, cache, layer.self_attn.scale)  # [T, H, hd]
            if layer_hook is not None:
                layer_hook(layer.layer)
            x = pieces.attention_output(layer, x, o)
        return self.lm_head(m.norm(x[logit_rows])).float()
