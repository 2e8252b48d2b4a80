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
import bisect
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

# Corpus: generated from embedded word lists with splitmix64, so it is identical everywhere.

_WORDS = """the of and to a in is it you that he was for on are with as I his they be at one have
this from or had by not word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so these
her long make thing see him two has look more day could go come did number sound no most people
my over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our under
name very through just form sentence great think say help low line differ turn cause much mean
before move right boy old too same tell does set three want air well also play small end put home
read hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often
letter until mile river car feet care second book carry took science eat room friend began idea
fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better true
during hundred five remember step early hold west ground interest reach fast verb sing listen six
table travel less morning ten simple several vowel toward war lay against pattern slow center love
person money serve appear road map rain rule govern pull cold notice voice unit power town fine
certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct able
pound done beauty drive stood contain front teach week final gave green oh quick develop ocean warm
free minute strong special mind behind clear tail produce fact street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record boat
common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate hot miss
brought heat snow tire bring yes distant fill east paint language among model server request cache
token prefill decode transfer block layer attention memory latency throughput queue batch stream
def return class import from self None True False lambda yield async await with try except raise
int str list dict float print range len value result error config data index buffer thread engine
café naïve über señor façade Ångström Straße déjà vu привет мир данные модель сервер λόγος κόσμος
你好 世界 我们 模型 推理 数据 计算 今天 时间 问题 学习 系统 服务 缓存 请求 的 是 在 一个 没有
こんにちは 世界 データ モデル 東京 안녕하세요 데이터 مرحبا بالعالم नमस्ते 🙂 😀 🚀 🎉 ❤️ 👍 🔥 ✨ 🌍 🤖""".split()

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh sk st str th tr".split()
_VOWELS = "a e i o u ai ea ou io".split()
_CODAS = ["", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]
_PUNCT = [".", ".", ".", ",", "?", "!", ":", ";", " -", "..."]
_MASK64 = (1 << 64) - 1


class _SplitMix64:
    """A tiny integer-only PRNG: the same sequence on every machine and Python version."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n


class _Zipf:
    """Samples indices 0..n-1 with integer weights ~ 1/(i+1)."""

    def __init__(self, n: int) -> None:
        self.cum: list[int] = []
        total = 0
        for i in range(n):
            total += 1_000_000 // (i + 1)
            self.cum.append(total)

    def sample(self, rng: _SplitMix64) -> int:
        return bisect.bisect_right(self.cum, rng.below(self.cum[-1]))


def _pseudo_words(rng: _SplitMix64, n: int) -> list[str]:
    words: list[str] = []
    for _ in range(n):
        parts = []
        for _ in range(1 + rng.below(3)):
            coda = _CODAS[rng.below(len(_CODAS))]
            parts.append(_ONSETS[rng.below(len(_ONSETS))] + _VOWELS[rng.below(len(_VOWELS))] + coda)
        words.append("".join(parts))
    return words


def _sentence(rng: _SplitMix64, lexicon: list[str], zipf: _Zipf) -> str:
    words = []
    for i in range(4 + rng.below(14)):
        roll = rng.below(100)
        if roll < 4:
            words.append(str(rng.below(10 ** (1 + rng.below(5)))))
        elif roll < 6:
            words.append("_".join(lexicon[zipf.sample(rng)] for _ in range(2)) + "()")
        else:
            word = lexicon[zipf.sample(rng)]
            words.append(word.capitalize() if i == 0 or roll < 9 else word)
    return " ".join(words) + _PUNCT[rng.below(len(_PUNCT))]


def corpus_lines(num_lines: int) -> list[str]:
    """Return the deterministic training corpus: `num_lines` lines of pseudo-text."""
    rng = _SplitMix64(0x6B7670757368)
    pseudo = _pseudo_words(rng, 12_000)
    lexicon: list[str] = []
    for i in range(max(len(_WORDS), len(pseudo))):  # interleave: real words get high frequency
        if i < len(_WORDS):
            lexicon.append(_WORDS[i])
        lexicon.append(pseudo[i])
    zipf = _Zipf(len(lexicon))
    lines = []
    for _ in range(num_lines):
        sentences = [_sentence(rng, lexicon, zipf) for _ in range(1 + rng.below(3))]
        sep = "\n" if rng.below(8) == 0 else " "
        lines.append(sep.join(sentences))
    return lines


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
