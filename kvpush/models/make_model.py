"""Random-weight Qwen3 checkpoints in Hugging Face format, with a locally trained BPE tokenizer.

`make_model(out_dir, preset, seed, dtype)` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json and kvpush_preset.json. Everything is a pure function
of (preset, seed, dtype): the tokenizer is trained on a corpus generated here from embedded word
lists with an integer-only PRNG, and the weights come from integer draws of a seeded
torch.Generator scaled in float64, so the files are byte-identical on any machine.

Weights are scaled so that activations stay O(1) through the layers and the final logits have a
standard deviation of `Preset.logit_std`: greedy decoding is then far from near-ties.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from kvpush.errors import ModelLoadError
from kvpush.models.corpus import corpus_lines

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Qwen-style ChatML; the assistant turn is opened when add_generation_prompt is set.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2/Qwen3's pre-tokenizer pattern: digits split one by one, words keep a leading space.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Preset:
    """Architecture sizes of one random model."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 1_000_000.0
    logit_std: float = 5.0
    # False: weights from torch.rand on the chosen init device (fast for ~1B parameters, and the same
    # only for the same device type and torch version) instead of the exact integer draws.
    exact_init: bool = True


PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", 1024, 64, 128, 2, 4, 2, 16, 4096, True),
    "small": Preset("small", 4096, 256, 768, 4, 8, 4, 32, 8192, False),
    "bench": Preset("bench", 8192, 384, 768, 8, 6, 3, 64, 16384, False),
    # ~1.04B parameters (Qwen3-1.7B's widths, 20 layers): for GPUs, in bfloat16 (scripts/gpu_check.sh)
    "gpu-1b": Preset("gpu-1b", 8192, 2048, 6144, 20, 16, 8, 128, 16384, False, exact_init=False),
}

@functools.lru_cache(maxsize=8)
def train_tokenizer(vocab_size: int) -> str:
    """Train the byte-level BPE and return its tokenizer.json text (cached per vocab size).

    The special tokens get ids 0, 1, 2. Raises ModelLoadError if the corpus cannot fill the vocab.
    """
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=16,
    )
    tok.train_from_iterator(corpus_lines(max(2500, vocab_size * 5 // 2)), trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ModelLoadError(
            f"tokenizer training produced {tok.get_vocab_size(with_added_tokens=True)} tokens, "
            f"expected {vocab_size}"
        )
    return tok.to_str(pretty=True)


def _added_token(content: str) -> dict:
    flags = ("lstrip", "normalized", "rstrip", "single_word")
    return {"content": content, **dict.fromkeys(flags, False), "special": True}


def tokenizer_config() -> dict:
    """Return the tokenizer_config.json contents (Qwen-style, ChatML chat template)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): _added_token(t) for i, t in enumerate(SPECIAL_TOKENS)},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def model_config(preset: Preset, dtype: str = "float32") -> dict:
    """Return the config.json contents of `preset` stored as `dtype`."""
    sizes = {k: v for k, v in asdict(preset).items() if k not in ("name", "logit_std", "exact_init")}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **sizes,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": preset.num_hidden_layers,
    }


def generation_config() -> dict:
    """Return the generation_config.json contents: greedy, stopping on <|im_end|> or <|endoftext|>."""
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "do_sample": False,
    }


def _uniform(gen: torch.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    """Uniform values with the given mean and std, computed exactly from integer draws."""
    bits = 24
    ints = torch.randint(0, 1 << bits, shape, generator=gen, dtype=torch.int64)
    centred = ints.to(torch.float64) - ((1 << bits) - 1) / 2  # exact: integers and halves
    half_width = std * math.sqrt(3.0)
    return (centred * (2 * half_width / (1 << bits)) + mean).to(torch.float32)


def _fast_uniform(gen: torch.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    """Uniform values with the given mean and std from torch.rand on the generator's device."""
    half_width = std * math.sqrt(3.0)
    values = torch.rand(shape, generator=gen, device=gen.device)
    return values.mul_(2 * half_width).add_(mean - half_width)


def _layer_shapes(p: Preset) -> list[tuple[str, tuple[int, ...], float]]:
    """(name suffix, shape, std) of one decoder layer; std 0 marks a norm weight (mean 1)."""
    h, q, kv, i = (
        p.hidden_size,
        p.num_attention_heads * p.head_dim,
        p.num_key_value_heads * p.head_dim,
        p.intermediate_size,
    )
    return [
        ("input_layernorm.weight", (h,), 0.0),
        ("self_attn.q_proj.weight", (q, h), 1 / math.sqrt(h)),
        ("self_attn.k_proj.weight", (kv, h), 1 / math.sqrt(h)),
        ("self_attn.v_proj.weight", (kv, h), 1 / math.sqrt(h)),
        ("self_attn.o_proj.weight", (h, q), 1 / math.sqrt(q)),
        ("self_attn.q_norm.weight", (p.head_dim,), 0.0),
        ("self_attn.k_norm.weight", (p.head_dim,), 0.0),
        ("post_attention_layernorm.weight", (h,), 0.0),
        ("mlp.gate_proj.weight", (i, h), 1 / math.sqrt(h)),
        ("mlp.up_proj.weight", (i, h), 1 / math.sqrt(h)),
        ("mlp.down_proj.weight", (h, i), 1 / math.sqrt(i)),
    ]


def make_weights(p: Preset, seed: int, dtype: str = "float32", init_device: str = "cpu") -> dict[str, torch.Tensor]:
    """Return the state dict (HF Qwen3 names, on the CPU) of a random model; deterministic in
    (p, seed, dtype), and for presets without `exact_init` also in the type of `init_device`.

    Norm weights are 1 +- 0.05; projections have std 1/sqrt(fan_in); the output matrix (the
    embedding when tied) has std logit_std/sqrt(hidden), so logits have std ~logit_std. When tied,
    the final norm gets random signs: otherwise h correlates with the input token's embedding and
    greedy decoding repeats one token forever.
    Raises ModelLoadError for an unsupported dtype.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    gen = torch.Generator(device="cpu" if p.exact_init else init_device).manual_seed(seed)
    uniform = _uniform if p.exact_init else _fast_uniform
    out_std = p.logit_std / math.sqrt(p.hidden_size)
    emb_std = out_std if p.tie_word_embeddings else 1.0
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": uniform(gen, (p.vocab_size, p.hidden_size), emb_std)
    }
    for layer in range(p.num_hidden_layers):
        for suffix, shape, std in _layer_shapes(p):
            value = uniform(gen, shape, 0.05, 1.0) if std == 0.0 else uniform(gen, shape, std)
            sd[f"model.layers.{layer}.{suffix}"] = value
    final_norm = uniform(gen, (p.hidden_size,), 0.05, 1.0)
    if p.tie_word_embeddings:  # random signs: no bias towards repeating the input token
        final_norm *= torch.randint(0, 2, (p.hidden_size,), generator=gen, device=gen.device).to(torch.float32) * 2 - 1
    sd["model.norm.weight"] = final_norm
    if not p.tie_word_embeddings:
        sd["lm_head.weight"] = uniform(gen, (p.vocab_size, p.hidden_size), out_std)
    return {k: v.to(DTYPES[dtype]).contiguous().cpu() for k, v in sd.items()}


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def make_model(out_dir: str, preset: str = "tiny", seed: int = 0, dtype: str = "float32",
               init_device: str = "cpu") -> str:
    """Write a random-weight Qwen3 checkpoint of `preset` into `out_dir` and return `out_dir`.

    `init_device` (e.g. cuda) draws the weights of presets without `exact_init` there (seconds, not
    a minute, for gpu-1b); exact presets ignore it.

    Raises ModelLoadError for an unknown preset or dtype.
    """
    if preset not in PRESETS:
        raise ModelLoadError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    weights = make_weights(p, seed, dtype, init_device)
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(train_tokenizer(p.vocab_size))
    _write_json(os.path.join(out_dir, "config.json"), model_config(p, dtype))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config())
    _write_json(os.path.join(out_dir, "generation_config.json"), generation_config())
    record: dict = {"preset": asdict(p), "seed": seed, "dtype": dtype}
    if p.exact_init:
        del record["preset"]["exact_init"]  # the exact presets' files stay as they were
    else:
        record["init_device"] = init_device
    _write_json(os.path.join(out_dir, "kvpush_preset.json"), record)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m kvpush.models.make_model OUT [--preset P] [--seed S] [--dtype D]`."""
    parser = argparse.ArgumentParser(description="Write a random-weight Qwen3 checkpoint.")
    parser.add_argument("out_dir")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    print(make_model(args.out_dir, args.preset, args.seed, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
