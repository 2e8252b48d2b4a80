"""P's first token first, for vLLM decode instances (`kvpush proxy --first-token from-prefill`).

vLLM computes the last prompt position again on D once the KV landed (its scheduler always leaves
one token to compute), so D's first token comes one decode step after its KV. P sampled that token
already. For a streamed greedy request the proxy sends P's token to the client as soon as P
answered, then relays D's stream without D's first token, after checking that it is the same one:

    WAITING (D answered 200, nothing sent yet)
      -> P_FIRST (P's answer came before D's first token: P's token sent)
           -> CHECKED (D's text starts with P's: that much dropped; the rest relayed as it comes)
              -> COMPLETE
           -> MISMATCH (D's text is another: an error event ends the stream, D is closed)
      -> D_FIRST (D's first token came first: D's stream relayed unchanged)

What the client reads is D's text, or P's token and then an error event: D's text is checked to start
with P's before anything of D's goes out, whether D sends its first token alone or (vLLM's API server
reading behind its engine) together with the next ones; D's answer ending, or its stream breaking
off, before it gave all of P's text is a mismatch too. An error D reports instead goes to the client
as it is. A server-side reasoning parser may call P's one token content and D's the reasoning: that
ends in the error event, not in wrong text.

Only where P's token is the one D computes and the chunks map one to one: a single prompt, streamed,
temperature 0, one choice, no beam search, no logprobs of any kind (`logprobs: 0` included), no echo,
no stop strings (vLLM holds text back for them), no token ids, prompt text or per-chunk usage asked
for, no tools; and P's answer a plain piece of text that ended by length (not a tool call or
reasoning). That text may be empty: vLLM holds back the text of a token that ends inside a character and
streams the token's chunk with empty text all the same, so the client gets that empty chunk from P and
then all of D's text (nothing of D's is dropped but D's own empty chunk). It may hold replacement
characters: vLLM's detokenizer emits them only for bytes that can no longer form a character (final, the
same on D, whose detokenizer sees the same prompt and token); the check against D's text stands anyway. Anything else goes through relay.py as it is. The chunks
P's token is sent in carry vLLM's id (both legs carry the same X-Request-Id, so vLLM names both
answers alike), P's `created`, model and (chat) role, and no `token_ids` fields.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from kvpush.protocol import http as H
from kvpush.proxy.legs import Dispatch

if TYPE_CHECKING:
    from kvpush.proxy.proxy import Proxy

log = logging.getLogger("kvpush.proxy")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Request fields under which P's first token is not what the client would get first from D, or a
# chunk of D's carries more than text (set at all: logprobs 0 asks for the sampled token's logprob)
_DISQUALIFY_SET = ("logprobs", "top_logprobs", "prompt_logprobs")
_DISQUALIFY = ("echo", "stop", "return_token_ids", "return_prompt_text", "tools", "include_stop_str_in_output",
               "use_beam_search")


class State(enum.Enum):
    P_FIRST = "p_first"  # P's text sent; D's stream has not given all of it yet
    CHECKED = "checked"  # D's text started with P's: the rest goes as it comes
    MISMATCH = "mismatch"  # D's text departs from P's (or ends before giving all of it)
    D_ERROR = "d_error"  # D reported an error instead of a token: it goes to the client as it is
    D_FIRST = "d_first"  # D's first token came first (or P's was none to send): D's stream unchanged


def eligible(body: dict[str, Any], stream: bool) -> bool:
    """Whether a request's first token may come from P (see the module docstring)."""
    temperature = body.get("temperature")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0
    options = body.get("stream_options")
    per_chunk_usage = isinstance(options, dict) and bool(options.get("continuous_usage_stats"))
    return (stream and greedy and body.get("n") in (None, 1) and body.get("best_of") in (None, 1)
            and not per_chunk_usage and not any(body.get(k) for k in _DISQUALIFY)
            and all(body.get(k) is None or body.get(k) is False for k in _DISQUALIFY_SET))  # 0 == False


@dataclass(frozen=True)
class PrefillAnswer:
    """What the client's first chunk(s) are made of: P's token's text and the answer's names."""

    text: str
    chat: bool
    id: str
    created: int
    model: str
    role: str = "assistant"  # chat: the answer's role (vLLM's --response-role, or the last message's)

    @classmethod
    def parse(cls, body: dict[str, Any], chat: bool) -> PrefillAnswer | None:
        """From P's (non-streamed, one-token) answer; None where it is no plain piece of text."""
        choice = (body.get("choices") or [{}])[0]
        role = "assistant"
        if chat:
            message = choice.get("message") or {}
            text, role = message.get("content"), str(message.get("role") or role)
            if message.get("tool_calls") or message.get("reasoning_content") or message.get("reasoning"):
                return None
        else:
            text = choice.get("text")
        if not isinstance(text, str) or choice.get("finish_reason") != "length":
            return None
        return cls(text, chat, str(body.get("id", "")), int(body.get("created") or time.time()),
                   str(body.get("model", "")), role)

    def chunks(self) -> list[dict[str, Any]]:
        """The chunks vLLM would stream for this token (chat: the role's, then the text's)."""
        if not self.chat:
            return [self._chunk("text_completion", {"index": 0, "text": self.text, "logprobs": None,
                                                    "finish_reason": None, "stop_reason": None})]
        return [self._chunk("chat.completion.chunk", {"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": None})
                for delta in ({"role": self.role, "content": ""}, {"content": self.text})]

    def _chunk(self, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def check_first(line: bytes, answer: PrefillAnswer, owed: str) -> tuple[State, str, bytes | None]:
    """D's line while `owed` (the end of P's text the client has and D's stream has not yet given) is
    not empty -> (the state after it, what is still owed, the line to send or None to drop it). vLLM may
    put several tokens in one chunk (when its API server reads behind the engine): D's text matches
    P's when it starts with it, in one chunk or over several, before D's answer ends."""
    if line.startswith(b"data: [DONE]"):
        return State.MISMATCH, owed, None  # D ended without giving all of P's text
    if not line.startswith(b"data: {"):
        return State.P_FIRST, owed, line  # SSE framing
    try:
        obj = json.loads(line[6:])
    except ValueError:
        return State.MISMATCH, owed, None
    if not isinstance(obj, dict) or "error" in obj:
        return State.D_ERROR, owed, line
    choices = obj.get("choices")
    if not choices:
        return State.P_FIRST, owed, line  # a usage chunk: as it is
    choice, ended = choices[0], choices[0].get("finish_reason") is not None
    if answer.chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
            return State.MISMATCH, owed, None
        if delta.get("role") and not text and not ended:
            return State.P_FIRST, owed, None  # the role's chunk: P's went already
    else:
        text = choice.get("text") or ""
    if text.startswith(owed):
        rest, owed = text[len(owed):], ""
    elif owed.startswith(text) and not ended:
        rest, owed = "", owed[len(text):]
    else:
        return State.MISMATCH, owed, None
    state = State.P_FIRST if owed else State.CHECKED
    if not rest and not ended and not obj.get("usage"):
        return state, owed, None
    if answer.chat:
        choice["delta"] = {"content": rest}
    else:
        choice["text"] = rest
    return state, owed, _sse(obj)


async def relay_first_from_prefill(proxy: Proxy, request: web.Request, d_resp: aiohttp.ClientResponse,
                                   d: Dispatch) -> web.StreamResponse:
    """Stream D's answer, P's token first where P answered before D's first token."""
    out = web.StreamResponse(headers=SSE_HEADERS)
    await out.prepare(request)
    lines = d_resp.content.__aiter__()
    pending = asyncio.ensure_future(lines.__anext__())
    complete = False
    try:
        if d.p_task is not None and not d.p_task.done():
            await asyncio.wait({d.p_task, pending}, return_when=asyncio.FIRST_COMPLETED)
        answer = d.prefill_answer if not pending.done() else None
        state = State.P_FIRST if answer is not None else State.D_FIRST
        owed = answer.text if answer is not None else ""
        if answer is not None:
            d.trace.set_once("proxy_first_chunk", time.time())
            for chunk in answer.chunks():
                await out.write(_sse(chunk))
        else:  # D's token came first, or P's answer was none to send (failed, or no plain text)
            proxy.metrics.first_from_prefill.labels(outcome="late" if pending.done() else "unusable").inc()
        while True:
            try:
                line: bytes | None = await pending
            except StopAsyncIteration:
                break
            if state is State.P_FIRST and answer is not None and line is not None:
                first = line
                state, owed, line = check_first(line, answer, owed)
                if state is State.MISMATCH:
                    await _mismatch(proxy, out, d, answer, first)
                    return out
                if state is State.CHECKED:
                    proxy.metrics.first_from_prefill.labels(outcome="relayed").inc()
            if line is not None:
                if line.startswith(b"data: {"):
                    d.trace.set_once("proxy_first_chunk", time.time())
                await out.write(line)
            pending = asyncio.ensure_future(lines.__anext__())
        if state is State.P_FIRST and answer is not None:  # D's stream broke off before giving P's text
            await _mismatch(proxy, out, d, answer, b"(end of stream)")
            return out
        complete = True
        await out.write_eof()
        proxy.metrics.requests.labels(status="200").inc()
    except ConnectionResetError:
        log.info("client left during the stream of %s", d.transfer_id)
    finally:
        if not pending.done():
            pending.cancel()
        elif not pending.cancelled() and not isinstance(pending.exception(), StopAsyncIteration | type(None)):
            log.debug("D's stream of %s broke off: %s", d.transfer_id, pending.exception())
        if complete:
            d_resp.release()
        else:
            d_resp.close()  # D sees the disconnect and aborts
    return out


async def _mismatch(proxy: Proxy, out: web.StreamResponse, d: Dispatch, answer: PrefillAnswer, first: bytes) -> None:
    proxy.metrics.first_from_prefill.labels(outcome="mismatch").inc()
    proxy.metrics.requests.labels(status="502").inc()
    message = (f"decode instance {d.decode.url} computed another first token than prefill instance "
               f"{d.prefill.url if d.prefill else '?'} (sent already); the answer cannot go on")
    log.warning("%s: %s: P's text %r, D's first chunk %s", d.transfer_id, message, answer.text,
                first.strip()[:300].decode(errors="replace"))
    await out.write(_sse(H.error_body(502, message)) + b"data: [DONE]\n\n")
    await out.write_eof()
