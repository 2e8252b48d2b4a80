"""Tokenizer (encode, decode, chat template) and the incremental detokenizer."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.errors import InvalidRequestError, ModelLoadError
from kvpush.models.make_model import make_model
from kvpush.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "naïve café Straße Ångström",
    "你好，世界！今天的模型推理很快。",
    "emoji 🙂🚀🎉 ❤️ 👍🏽 family 👨‍👩‍👧",
    "tabs\tand\nnew lines\r\n  indented   spaces  ",
    "mixed: привет мир λόγος مرحبا नमस्ते 안녕하세요 123456",
    "",
]
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("tiny")), "tiny", seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


def _write_llama_style(path: str, with_template: bool = True) -> str:
    """A SentencePiece-like (Metaspace, byte fallback, <s> post-processor) tokenizer, built offline."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzHW,.!"]
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"), ("o", "r")]
    for piece in pieces + [a + b for a, b in merges]:
        vocab.setdefault(piece, len(vocab))
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    if with_template:
        config["chat_template"] = LLAMA_TEMPLATE
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "bos_token_id": 1}, f)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(_write_llama_style(str(tmp_path_factory.mktemp("llama"))))


def _stream(
    tok: Tokenizer, ids: list[int], chunks: list[int] | None = None, **kwargs
) -> tuple[list[str], bool, str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas, stopped, i, sizes = [], False, 0, iter(chunks or [])
    while i < len(ids) and not stopped:
        n = max(1, next(sizes, 1))
        delta, stopped = detok.update(ids[i : i + n])
        deltas.append(delta)
        i += n
    return deltas, stopped, detok.flush()


# ----------------------------------------------------------------------------- Tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_ids_and_sizes(tok):
    assert tok.vocab_size == 1024
    assert tok.eos_token_id == 2 and tok.eos_token_ids == {0, 2}
    assert tok.bos_token_id is None and tok.pad_token_id == 0 and not tok.add_bos_token
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1 and tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, *tok.encode("hi"), 2]) == "hi"
    assert tok.decode([1, *tok.encode("hi"), 2], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template_is_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages) == expected
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=False)
        == expected[: -len("<|im_start|>assistant\n")]
    )
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids.count(2) == 2 and tok.decode(ids, skip_special_tokens=False) == expected
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_matches_transformers(tiny_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "Hello 你好"}, {"role": "assistant", "content": "Hi!"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tok.encode(TEXTS[3]) == hf.encode(TEXTS[3], add_special_tokens=False)


def test_chat_errors(tok):
    with pytest.raises(InvalidRequestError, match="unsupported role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([])
    with pytest.raises(InvalidRequestError):
        tok.encode(123)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        tok.decode([-1])


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json") as info:
        Tokenizer.from_pretrained(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_llama_style_checkpoint(llama):
    assert llama.bos_token_id == 1 and llama.eos_token_ids == {2} and llama.add_bos_token
    ids = llama.encode("hello world")
    assert ids[0] == 1 and ids.count(1) == 1
    assert llama.encode("hello world", add_bos=False) == ids[1:]
    assert llama.decode(ids) == "hello world"
    assert llama.decode(llama.encode("hello 你好 🙂")) == "hello 你好 🙂"  # byte fallback
    messages = [{"role": "user", "content": " hello "}, {"role": "assistant", "content": "world"}]
    assert llama.apply_chat_template(messages) == "<s>[INST] hello [/INST] world </s>"
    assert llama.encode_chat(messages).count(1) == 1  # the template's bos, not a second one
    with pytest.raises(InvalidRequestError, match="Only user and assistant"):
        llama.apply_chat_template([{"role": "system", "content": "x"}])


def test_no_chat_template(tmp_path):
    tok = Tokenizer.from_pretrained(_write_llama_style(str(tmp_path / "plain"), with_template=False))
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_matches_decode(tok, llama, text):
    for t in (tok, llama):
        ids = t.encode(text, add_bos=False)
        deltas, stopped, rest = _stream(t, ids)
        assert not stopped and "".join(deltas) + rest == t.decode(ids)
        assert all("\ufffd" not in d for d in deltas)


def test_partial_utf8_is_held_back(tok):
    ids = [tok._tok.token_to_id(c) for c in "ðŁĻĤ"]  # the four bytes of U+1F642, one token each
    detok = IncrementalDetokenizer(tok)
    assert [detok.update([i]) for i in ids] == [("", False)] * 3 + [("🙂", False)]
    detok = IncrementalDetokenizer(tok)
    assert detok.update(ids[:2]) == ("", False)
    assert detok.flush() == "\ufffd"


@given(data=st.data())
@SLOW
def test_detokenizer_property_random_ids(tok, data):
    """Any ids, including lone bytes that form invalid UTF-8 and special tokens."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    skip = data.draw(st.booleans())
    deltas, stopped, rest = _stream(tok, ids, chunks, skip_special_tokens=skip)
    assert not stopped
    assert "".join(deltas) + rest == tok.decode(ids, skip_special_tokens=skip)


@given(data=st.data())
@SLOW
def test_detokenizer_property_llama_style(llama, data):
    """Valid text pieces and special tokens. (A ByteFallback decoder replaces a whole run of byte
    tokens when any of it is invalid UTF-8, so random byte ids are not a fair test there.)"""
    pieces = data.draw(st.lists(st.one_of(st.text(max_size=6), st.sampled_from([[1], [2]])), max_size=8))
    ids = [i for p in pieces for i in (p if isinstance(p, list) else llama.encode(p, add_bos=False))]
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    skip = data.draw(st.booleans())
    deltas, stopped, rest = _stream(llama, ids, chunks, skip_special_tokens=skip)
    assert "".join(deltas) + rest == llama.decode(ids, skip_special_tokens=skip)


@given(data=st.data())
@SLOW
def test_stop_strings_property(tok, data):
    text = data.draw(st.sampled_from(TEXTS[:-1]))
    ids = tok.encode(text)
    full = tok.decode(ids)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start : start + data.draw(st.integers(1, 4))])
    include = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=40))
    deltas, stopped, rest = _stream(tok, ids, chunks, stop=stops, include_stop_str=include)
    # the stop string completed first wins; on a tie the longest one
    end, start = min((full.find(s) + len(s), full.find(s)) for s in stops)
    assert stopped and rest == ""
    assert "".join(deltas) == full[: end if include else start]


def test_stop_string_across_tokens(tok):
    ids = tok.encode("alpha beta gamma delta")
    deltas, stopped, rest = _stream(tok, ids, stop=["a gam"])
    assert stopped and "".join(deltas) == "alpha bet" and rest == ""
    detok = IncrementalDetokenizer(tok, stop=["a gam"], include_stop_str=True)
    out = "".join(detok.update([i])[0] for i in ids)
    assert out == "alpha beta gam" and detok.update([5]) == ("", True)


def test_stop_prefix_is_released_at_flush(tok):
    ids = tok.encode("the end is near")
    deltas, stopped, rest = _stream(tok, ids, stop=["nearly"])
    assert not stopped and rest.endswith("near") and "".join(deltas) + rest == "the end is near"


def test_prompt_context_keeps_leading_space(llama):
    prompt = llama.encode("hello")
    out = llama.encode("hello world", add_bos=False)[1:]  # "▁w", "or", ...: starts with a space
    detok = IncrementalDetokenizer(llama, prompt_ids=prompt)
    text = "".join(detok.update([i])[0] for i in out) + detok.flush()
    assert text == " world" and detok.token_ids == out
    plain = IncrementalDetokenizer(llama)
    assert "".join(plain.update([i])[0] for i in out) + plain.flush() == "world"


def test_update_after_flush_is_an_error(tok):
    detok = IncrementalDetokenizer(tok)
    detok.update(tok.encode("x"))
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.update([5])
