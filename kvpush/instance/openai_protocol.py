"""OpenAI request bodies (msgspec structs) and their translation to engine sampling parameters.

Unknown fields are ignored, as OpenAI's API does; fields kvpush cannot honour get a 400.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush.engine.sampling_params import SamplingParams
from kvpush.errors import InvalidRequestError, ProtocolError
from kvpush.protocol.kv_params import RequestLegParams
from kvpush.protocol.prompts import split_prompt


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # kvpush's (typed by leg_params) or vLLM's shape

    def leg_params(self) -> RequestLegParams | None:
        """kvpush's own leg parameters (a ``type``-tagged object, set by kvpush's proxy), typed; a bad
        one is a 400 naming ``kv_transfer_params``. vLLM-shaped ones are translated by vllm_compat."""
        if self.kv_transfer_params is None:
            return None
        try:
            return msgspec.convert(self.kv_transfer_params, RequestLegParams)  # type: ignore[arg-type]
        except ProtocolError as e:  # a leg parameter's own check
            raise InvalidRequestError(str(e), param="kv_transfer_params") from e
        except msgspec.ValidationError as e:
            raise InvalidRequestError(f"invalid kv_transfer_params: {e}", param="kv_transfer_params") from e

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        _require(self.n == 1, "only n=1 is supported", "n")
        _require(self.presence_penalty == 0.0, "presence_penalty is not supported", "presence_penalty")
        _require(self.frequency_penalty == 0.0, "frequency_penalty is not supported", "frequency_penalty")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            min_tokens=self.min_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common, kw_only=True):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string, token ids, or a list of either)."""
        _require(not self.echo, "echo is not supported", "echo")
        _require(self.suffix is None, "suffix is not supported", "suffix")
        prompts = split_prompt(self.prompt)
        if prompts is None:
            raise InvalidRequestError(
                "prompt must be a non-empty string, a list of token ids, or a list of those", param="prompt")
        return prompts


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        if isinstance(self.content, list):
            bad = [p.type for p in self.content if p.type != "text"]
            _require(not bad, f"unsupported content part type {bad[:1]}", "messages")
            return {"role": self.role, "content": "".join(p.text or "" for p in self.content)}
        return {"role": self.role, "content": self.content or ""}


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def message_dicts(self) -> list[dict[str, str]]:
        _require(bool(self.messages), "messages must not be empty", "messages")
        roles = {"system", "user", "assistant", "developer", "tool"}
        bad = [m.role for m in self.messages if m.role not in roles]
        _require(not bad, f"unknown message role {bad[:1]}", "messages")
        return [m.as_dict() for m in self.messages]

    def chat_logprobs(self) -> int | None:
        if not self.logprobs:
            _require(self.top_logprobs is None, "top_logprobs requires logprobs=true", "top_logprobs")
            return None
        return self.top_logprobs or 0


_decoders: dict[type, msgspec.json.Decoder] = {}


def parse_body(body: bytes, cls: type[msgspec.Struct]) -> Any:
    """Decode and validate a JSON body; InvalidRequestError with a readable message on any problem."""
    decoder = _decoders.setdefault(cls, msgspec.json.Decoder(cls))
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(f"invalid request: {e}") from e
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"malformed JSON body: {e}") from e


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
