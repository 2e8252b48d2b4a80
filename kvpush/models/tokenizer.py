"""Tokenizer and incremental detokenizer over a Hugging Face checkpoint directory.

`Tokenizer` wraps `tokenizers.Tokenizer` (tokenizer.json) and reads tokenizer_config.json,
generation_config.json and config.json for special tokens, eos ids and the chat template, which is
rendered with a sandboxed jinja2 environment the way transformers does.

`IncrementalDetokenizer` turns a stream of token ids into text deltas: it decodes a small window
(prefix/read offsets, as vLLM does), never emits a partial UTF-8 character, and applies stop strings
that may span token boundaries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvpush.errors import InvalidRequestError, ModelLoadError

REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: str) -> dict:
    """Return the JSON object in `path`, or {} when the file does not exist."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _int_ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _load_chat_template(path: str, tok_config: dict) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json's chat_template (a string or named list)."""
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _normalise_message(message: Any) -> dict:
    """Check one chat message; a list of text parts (OpenAI style) becomes one string."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError("each message must be an object with a string 'role'", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError("only text content parts are supported", param="messages")
            texts.append(part["text"])
        message = {**message, "content": "\n".join(texts)}
    return message


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, chat template, special token ids."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        tok_config: dict,
        eos_token_ids: set[int],
        chat_template: str | None,
        path: str = "",
    ) -> None:
        self._tok = tok
        self.path = path
        self.bos_token = _token_content(tok_config.get("bos_token"))
        self.eos_token = _token_content(tok_config.get("eos_token"))
        self.pad_token = _token_content(tok_config.get("pad_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.eos_token_ids: set[int] = set(eos_token_ids)
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        elif self.eos_token_ids:
            self.eos_token_id = min(self.eos_token_ids)
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        add_bos = tok_config.get("add_bos_token")
        self.add_bos_token: bool = bool(add_bos) if add_bos is not None else self._post_processor_adds_bos()

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Load the tokenizer of the checkpoint directory `path`.

        Raises ModelLoadError when tokenizer.json is missing or unreadable, or a JSON file is broken.
        """
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise ModelLoadError(f"no tokenizer.json in {path!r} (looked for {tok_path})")
        try:
            tok = tokenizers.Tokenizer.from_file(tok_path)
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"cannot load {tok_path}: {e}") from e
        tok_config = _read_json(os.path.join(path, "tokenizer_config.json"))
        eos = _int_ids(_read_json(os.path.join(path, "config.json")).get("eos_token_id"))
        eos |= _int_ids(_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id"))
        return cls(tok, tok_config, eos, _load_chat_template(path, tok_config), path)

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        ids = self._tok.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    def token_to_id(self, token: str | None) -> int | None:
        """Return the id of `token`, or None when it is None or not in the vocabulary."""
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Return the vocabulary string of `token_id`, or None when it is out of range."""
        return self._tok.id_to_token(token_id)

    def special_token_ids(self) -> set[int]:
        """Ids of the tokens the tokenizer marks special (bos, eos, pad, chat markers, ...)."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Return the ids of `text`. Special tokens written in the text are recognised; none is added
        except a bos when `add_bos` (default: the checkpoint's add_bos_token) is true.

        Raises InvalidRequestError when `text` is not a string.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, not {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        use_bos = self.add_bos_token if add_bos is None else add_bos
        if use_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Return the text of `ids` (ids outside the vocabulary decode to nothing).

        Raises InvalidRequestError for negative or non-integer ids.
        """
        try:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as e:
            raise InvalidRequestError(f"invalid token ids: {e}") from e

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Return the prompt text for `messages` rendered with the checkpoint's chat template.

        Extra keyword arguments (tools, enable_thinking, ...) are passed to the template.
        Raises InvalidRequestError when there is no template, the messages are malformed, or the
        template rejects them.
        """
        if self.chat_template is None:
            raise InvalidRequestError(
                f"the tokenizer of {self.path or 'this model'} has no chat template; use the completions API",
                param="messages",
            )
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        msgs = [_normalise_message(m) for m in messages]
        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                **kwargs,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from e

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Return the prompt ids for `messages`: the rendered template, encoded without adding a bos
        (templates write their own). Raises InvalidRequestError like apply_chat_template."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_bos=False)


class IncrementalDetokenizer:
    """Streams text deltas from token ids, holding back partial characters and stop-string prefixes.

    Without a stop string hit, the concatenation of all deltas and `flush()` equals
    `tokenizer.decode(all_ids)` (for byte-level BPE on any ids; for ByteFallback decoders, which
    replace a whole run of byte tokens once any of it is invalid UTF-8, on valid text). `prompt_ids` (optional) gives a few tokens of left context so that
    decoders which strip a leading space (SentencePiece) render the first output token correctly;
    the prompt text itself is never emitted.
    """

    CONTEXT_TOKENS = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self.include_stop_str = include_stop_str
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: decoding from here reproduces the text already emitted
        self._read = 0  # ids before this have been turned into text
        self._pending = ""  # decoded text held back because it may start a stop string
        self.stopped = False
        self._flushed = False
        if prompt_ids:
            context = list(prompt_ids[-self.CONTEXT_TOKENS :])
            if not self._decode(context).endswith(REPLACEMENT_CHAR):
                self._ids, self._read = context, len(context)
        self._offset = len(self._ids)  # number of prompt-context ids in self._ids

    @property
    def token_ids(self) -> list[int]:
        """The output ids seen so far (without the prompt context)."""
        return self._ids[self._offset :]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_step(self, final: bool) -> str:
        """Return the text of ids[read:], advancing the offsets when it is complete."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if final:
            self._prefix = self._read = len(self._ids)
            return new_text[len(prefix_text) :]
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that ends first in `text` (the longest on a tie), with its index."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                best = (i, s)
        return best

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _emit(self, delta: str, final: bool) -> str:
        text = self._pending + delta
        self._pending = ""
        hit = self._find_stop(text) if self._stop else None
        if hit is not None:
            index, stop = hit
            self.stopped = True
            return text[:index] + (stop if self.include_stop_str else "")
        hold = 0 if final else self._partial_stop_len(text)
        if hold:
            self._pending = text[-hold:]
            return text[:-hold]
        return text

    def update(self, new_token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add generated ids; return (new text, whether a stop string was hit).

        After a hit the text is cut before the stop string (after it with include_stop_str) and
        every later call returns ("", True). Raises RuntimeError after flush().
        """
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.update() called after flush()")
        if self.stopped:
            return "", True
        if not new_token_ids:
            return "", False
        self._ids.extend(new_token_ids)
        return self._emit(self._decode_step(final=False), final=False), self.stopped

    def flush(self) -> str:
        """End the stream: return the text still held back (a trailing partial character decodes
        to U+FFFD, a stop-string prefix is released), or "" after a stop string hit."""
        if self._flushed or self.stopped:
            self._flushed = True
            return ""
        self._flushed = True
        return self._emit(self._decode_step(final=True), final=True)
