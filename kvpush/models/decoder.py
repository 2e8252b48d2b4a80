"""Llama-family decoder (Llama, Qwen2, Qwen3) over the paged KV cache.

Projections are fused at load time (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`); the
loader maps Hugging Face tensor names onto them. Qwen3 adds per-head RMSNorm on q and k.

A layer runs as three pieces: `attention_input` (norm, q/k/v projection, q/k norm, rotary),
`attend` (writes K/V to the paged cache, attends over it; one opaque op under torch.compile) and
`attention_output` (o_proj, MLP, residuals). `decoder_layers` runs the embedding and every layer;
`decoder_logits` adds the selection of the rows to sample, the final norm, the LM head and each row's
greedy token. A compiler turns `decoder_logits` into one graph (`CausalLM.compiled_forward`) with the
token count and the sampled rows' count symbolic: the eager ops that ran after the graph each paid
tens of microseconds on one core (their code and data evicted by the weights the graph had just read:
~0.5 ms of a batch-16 decode step, 2026-12-07).

Linears are built as `nn.Linear` (MKL on a CPU). With `--linear-backend onednn` the loader replaces
them by `PackedLinear` (layers/linear.py: each weight reordered once into oneDNN's blocked layout, in
place of the loaded one); `auto`, the default, times both on the model's shapes at start-up and keeps
the faster (engine/linear_choice.py), because the winner depends on the CPU. On an earlier machine (CPU
not recorded; compiled, same process, alternating) packing lost where TPOT at low load is set: a decode
step 4.37 ms plain vs 6.01 packed at batch 1, 5.05 vs 6.47 at 2, equal at 4 and 8, 17.09 vs 16.03 at
16, a 512-token prefill 101 vs 104 ms. On an AMD EPYC (Zen 4, family 25 model 17) it won everywhere:
docs/results/engine.md has the side-by-side run (`benchmarks/engine_ab.py --a linear=mkl --b
linear=onednn`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvpush.engine.kv_cache import KVCache
from kvpush.layers.attention import AttentionMetadata, attend, forward_context
from kvpush.layers.linear import residual_linear
from kvpush.layers.norm import RMSNorm
from kvpush.layers.rotary import RotaryEmbedding, apply_rotary
from kvpush.models.arch import ArchConfig


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
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


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> silu(gate) * up [T, intermediate], the input of down_proj."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(x))


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
    x = residual_linear(layer.self_attn.o_proj, o.reshape(x.shape[0], -1), x)
    return residual_linear(layer.mlp.down_proj, layer.mlp.act(layer.post_attention_layernorm(x)), x)


def decoder_layers(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """input_ids, positions: [T] -> hidden states after the last layer [T, hidden] (before the final
    norm). Attends in the current forward_context."""
    m = model.model
    x = m.embed_tokens(input_ids)  # [T, hidden]
    cos, sin = m.rotary.cos_sin(positions, x.dtype)  # [T, 1, hd]
    for layer in cast(list[DecoderLayer], m.layers):
        q, k, v = attention_input(layer, x, cos, sin)
        o = attend(q, k, v, layer.layer, layer.self_attn.scale)  # [T, H, hd]
        x = attention_output(layer, x, o)
    return x


def decoder_logits(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                   logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, positions: [T]; logit_rows: [S] -> the logits of those rows [S, vocab] fp32 and each row's
    greedy token [S] int64 (its first maximum, as torch.argmax). Attends in the current forward_context."""
    x = decoder_layers(model, input_ids, positions)  # [T, hidden]
    logits = model.lm_head(model.model.norm(x[logit_rows])).float()  # [S, vocab]
    return logits, logits.max(dim=-1).indices


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
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # decoder_logits compiled (engine/compiler.py); when set, every forward runs it
        self.compiled_forward: Callable[[CausalLM, torch.Tensor, torch.Tensor, torch.Tensor],
                                        tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(self, input_ids, positions, meta: AttentionMetadata, cache: KVCache, logit_rows: torch.Tensor,
                layer_hook: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T]; logit_rows: [S] rows whose logits are wanted -> their logits [S, vocab]
        fp32 and greedy tokens [S] int64 (decoder_logits).

        layer_hook(l) runs right after layer l wrote its K/V to the cache (layer-wise push).
        """
        with forward_context(meta, cache, layer_hook):
            return (self.compiled_forward or decoder_logits)(self, input_ids, positions, logit_rows)
