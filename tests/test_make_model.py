"""Random-weight Qwen3 checkpoints: HF compatibility, logit spread, reproducibility, presets."""

from __future__ import annotations

import filecmp
import json
import os

import pytest
import torch
from safetensors import safe_open

from kvpush.errors import ModelLoadError
from kvpush.models.make_model import (
    CHAT_TEMPLATE,
    IM_END_ID,
    PRESETS,
    SPECIAL_TOKENS,
    main,
    make_model,
    make_weights,
    model_config,
    train_tokenizer,
)

transformers = pytest.importorskip("transformers")

FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "kvpush_preset.json",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("tiny")), "tiny", seed=0)


@pytest.fixture(scope="module")
def hf_tiny(tiny):
    return transformers.Qwen3ForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_writes_all_files(tiny):
    for name in FILES:
        assert os.path.isfile(os.path.join(tiny, name)), name
    with open(os.path.join(tiny, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["eos_token_id"] == IM_END_ID and cfg["rope_scaling"] is None and cfg["attention_bias"] is False
    with open(os.path.join(tiny, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    assert tcfg["chat_template"] == CHAT_TEMPLATE
    assert (tcfg["eos_token"], tcfg["bos_token"], tcfg["pad_token"]) == ("<|im_end|>", None, "<|endoftext|>")


def test_tensor_names_match_transformers(tiny):
    config = transformers.Qwen3Config.from_pretrained(tiny)
    with torch.device("meta"):
        reference = transformers.Qwen3ForCausalLM(config).state_dict()
    ours = _tensors(tiny)
    expected = {k: v.shape for k, v in reference.items() if k != "lm_head.weight"}  # tiny is tied
    assert {k: v.shape for k, v in ours.items()} == expected
    assert "model.layers.1.self_attn.q_norm.weight" in ours


def test_untied_preset_has_lm_head():
    p = PRESETS["small"]
    config = transformers.Qwen3Config(**{k: v for k, v in model_config(p).items() if k != "architectures"})
    with torch.device("meta"):
        reference = transformers.Qwen3ForCausalLM(config).state_dict()
    ours = make_weights(p, seed=0)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in reference.items()}


def test_logits_are_well_spread(hf_tiny):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, hf_tiny.config.vocab_size, (2, 64), generator=gen)
    with torch.no_grad():
        logits = hf_tiny(ids).logits.float()
    assert torch.isfinite(logits).all()
    std = logits.std(dim=-1).mean().item()
    assert 3.5 < std < 6.5, std
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    assert gap.median().item() > 0.2
    assert (gap < 0.05).float().mean().item() < 0.1


def test_greedy_output_varies(hf_tiny):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, hf_tiny.config.vocab_size, (1, 12), generator=gen)
    with torch.no_grad():
        out = hf_tiny.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, 12:].tolist()
    assert len(set(new)) >= 5, new
    assert sum(t == prompt[0, -1].item() for t in new) < 5  # no copying of the last input token


def test_same_seed_same_bytes(tiny, tmp_path):
    again = make_model(str(tmp_path / "again"), "tiny", seed=0)
    for name in FILES:
        assert filecmp.cmp(os.path.join(tiny, name), os.path.join(again, name), shallow=False), name


def test_different_seed_different_weights(tiny, tmp_path):
    other = make_model(str(tmp_path / "other"), "tiny", seed=1)
    assert not filecmp.cmp(
        os.path.join(tiny, "model.safetensors"), os.path.join(other, "model.safetensors"), shallow=False
    )
    # the tokenizer depends only on the vocabulary size
    assert filecmp.cmp(
        os.path.join(tiny, "tokenizer.json"), os.path.join(other, "tokenizer.json"), shallow=False
    )


def test_tokenizer_training_is_deterministic():
    first = train_tokenizer(PRESETS["tiny"].vocab_size)
    train_tokenizer.cache_clear()
    second = train_tokenizer(PRESETS["tiny"].vocab_size)
    assert first == second
    vocab = json.loads(first)
    assert [t["content"] for t in vocab["added_tokens"]] == list(SPECIAL_TOKENS)
    assert [t["id"] for t in vocab["added_tokens"]] == [0, 1, 2]
    assert all(t["special"] for t in vocab["added_tokens"])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_configs_are_consistent(name):
    p = PRESETS[name]
    cfg = model_config(p)
    config = transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.head_dim == p.head_dim and config.vocab_size == p.vocab_size
    assert config.tie_word_embeddings is p.tie_word_embeddings
    assert max(cfg["bos_token_id"], cfg["eos_token_id"], len(SPECIAL_TOKENS)) < p.vocab_size
    from kvpush.models.arch import parse_arch_config

    arch = parse_arch_config(cfg)
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (
        p.num_hidden_layers,
        p.num_key_value_heads,
        p.head_dim,
    )
    assert arch.qk_norm and arch.eos_token_ids == (IM_END_ID,)


def test_preset_sizes():
    assert not PRESETS["small"].tie_word_embeddings and PRESETS["tiny"].tie_word_embeddings
    with pytest.raises(AttributeError):
        PRESETS["tiny"].hidden_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_export(tmp_path, dtype):
    path = make_model(str(tmp_path / dtype), "tiny", seed=0, dtype=dtype)
    tensors = _tensors(path)
    assert {t.dtype for t in tensors.values()} == {getattr(torch, dtype)}
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == dtype
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.dtype == getattr(torch, dtype) and torch.isfinite(logits).all()


def test_bad_preset_and_dtype(tmp_path):
    with pytest.raises(ModelLoadError, match="preset"):
        make_model(str(tmp_path / "x"), "huge")
    with pytest.raises(ModelLoadError, match="dtype"):
        make_model(str(tmp_path / "y"), "tiny", dtype="int8")


def test_command_line(tmp_path, capsys):
    assert main([str(tmp_path / "cli"), "--preset", "tiny", "--seed", "5"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    with open(tmp_path / "cli" / "kvpush_preset.json") as f:
        assert json.load(f)["seed"] == 5


def test_fast_init_preset_is_seeded_and_scaled():
    """Presets without exact_init (gpu-1b) draw with torch.rand: same seed, same weights; right spread."""
    import dataclasses

    p = dataclasses.replace(PRESETS["small"], name="fast-small", exact_init=False)
    a, b = make_weights(p, seed=3), make_weights(p, seed=3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], make_weights(p, seed=4)["lm_head.weight"])
    q = a["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() * (p.hidden_size**0.5) - 1.0) < 0.05 and abs(q.mean().item()) < 0.01
    norm = a["model.layers.0.input_layernorm.weight"]
    assert 0.9 < norm.min().item() and norm.max().item() < 1.1
    assert "exact_init" not in model_config(p)
