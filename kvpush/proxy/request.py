"""The client's request as the proxy sees it: parsed once at the front door, typed from there on.

The proxy forwards a request unchanged but for what it owns (the legs' kv_transfer_params, and a
batch's one prompt per dispatch), so a ClientRequest keeps the body as the client sent it beside the
fields the proxy reads. The instances validate the body (and answer its 4xx); the proxy itself
refuses only what is not a JSON object, or a body that sets kv_transfer_params.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from kvpush.config import FirstToken
from kvpush.protocol import kv_params as kp
from kvpush.protocol.prompts import split_prompt

COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class ClientRequest:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # as the client sent it: what every leg forwards
    stream: bool
    prompt: object = None  # completions: the prompt as sent (text, token ids, or a list of those)
    messages: object = None  # chat: the messages as sent
    wants_logprobs: bool = False
    seeded: bool = False  # samples with a seed (at a temperature other than 0)

    @classmethod
    def parse(cls, path: str, data: bytes) -> ClientRequest:
        """The request's body; 400 (web.HTTPBadRequest) when it is not a JSON object or sets
        kv_transfer_params."""
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise web.HTTPBadRequest(reason=f"malformed JSON body: {e}") from e
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(reason="the request body must be a JSON object")
        if "kv_transfer_params" in body:
            raise web.HTTPBadRequest(reason="kv_transfer_params is set by the proxy, not by clients")
        return cls.of(path, body)

    @classmethod
    def of(cls, path: str, body: dict[str, Any]) -> ClientRequest:
        logprobs, temperature = body.get("logprobs"), body.get("temperature")
        chat = "messages" in body
        return cls(path, body, stream=bool(body.get("stream")),
                   prompt=None if chat else body.get("prompt"), messages=body.get("messages") if chat else None,
                   wants_logprobs=logprobs is not None and logprobs is not False,
                   seeded=body.get("seed") is not None and (temperature is None or temperature != 0))

    def batch(self) -> list | None:
        """The prompts of a completions request with more than one; None for anything else (including
        bodies an instance rejects: they go to one P/D pair, which answers the 4xx)."""
        if self.path != COMPLETIONS:
            return None
        prompts = split_prompt(self.prompt)
        return prompts if prompts is not None and len(prompts) > 1 else None

    def with_prompt(self, prompt: str | list[int]) -> ClientRequest:
        """One prompt of a batch, as a request of its own."""
        return replace(self, body=dict(self.body, prompt=prompt), prompt=prompt)

    def leg(self, params: kp.PrefillLegParams | kp.DecodeLegParams | None, vllm: bool = False) -> dict[str, Any]:
        """The body of a leg: the client's, with the leg's kv_transfer_params (none: D alone, the local
        route). kvpush's P connector caps its leg to one token, and P answers one JSON body whatever
        `stream` says; a vLLM P (`vllm`: its connector cannot) gets that asked of it in the body."""
        if params is None:
            return self.body
        body = dict(self.body, kv_transfer_params=kp.params_to_dict(params))
        if vllm and isinstance(params, kp.PrefillLegParams):
            body.update(max_tokens=1, stream=False)
            body.pop("stream_options", None)
            if "max_completion_tokens" in body:
                body["max_completion_tokens"] = 1
            if isinstance(body.get("min_tokens"), int):
                body["min_tokens"] = min(body["min_tokens"], 1)
        return body

    def first_token(self, configured: FirstToken) -> FirstToken:
        """`from-prefill` only where P's first token is exactly what D would sample: not when the client
        asks for logprobs (P's are not transferred) or samples with a seed (P's generator is not D's)."""
        return FirstToken.RECOMPUTE if self.wants_logprobs or self.seeded else configured
