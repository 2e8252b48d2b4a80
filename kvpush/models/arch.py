"""Architecture description parsed from a Hugging Face config.json (Llama and Qwen3 families)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvpush.errors import ModelLoadError

SUPPORTED = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]

    @property
    def family(self) -> str:
        return SUPPORTED[self.architecture]


def load_arch_config(model_dir: str) -> ArchConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"no config.json in {model_dir!r}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    return parse_arch_config(raw)


def parse_arch_config(raw: dict) -> ArchConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {raw.get('hidden_act')!r} (only silu)")
    try:
        return _build(arch, raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json is missing or has a bad field: {e}") from e


def _build(arch: str, raw: dict) -> ArchConfig:
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    eos = raw.get("eos_token_id")
    family = SUPPORTED[arch]
    return ArchConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=family == "qwen3",
        attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
    )
