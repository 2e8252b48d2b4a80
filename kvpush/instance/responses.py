"""OpenAI response bodies: completions, chat completions, stream chunks, usage, logprobs (error bodies,
JSON and SSE framing: kvpush/protocol/http.py)."""

from __future__ import annotations

import time

from kvpush.instance.generation import GenEvent, GenState
from kvpush.instance.messages import LogprobEntry
from kvpush.models.tokenizer import Tokenizer
from kvpush.protocol.trace import Trace


def usage(states: list[GenState]) -> dict:
    prompt = sum(len(s.prompt_token_ids) for s in states)
    completion = sum(len(s.token_ids) for s in states)
    cached = sum(s.num_cached_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def extras(state: GenState) -> dict:
    """kvpush fields a response carries for the proxy and the benchmark."""
    out: dict = {}
    if state.kv_transfer_params is not None:
        out["kv_transfer_params"] = state.kv_transfer_params
    trace = (state.trace or Trace()).merged(state.stamps).stamps()
    if trace:
        out["kvpush_trace"] = trace
        # what --kv-mode auto learns from: the prompt's length and how much of it was cached here
        out["kvpush_prompt"] = {"tokens": len(state.prompt_token_ids), "cached_tokens": state.num_cached_tokens}
    return out


# ---- completions ---------------------------------------------------------------------------
def completion_logprobs(tok: Tokenizer, entries: list[LogprobEntry], offset: int = 0) -> dict:
    tokens = [tok.decode([e.token_id], skip_special_tokens=False) for e in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{tok.decode([i], skip_special_tokens=False): lp for i, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def completion(rid: str, model: str, states: list[GenState], tok: Tokenizer, want_logprobs: bool) -> dict:
    choices = [{"index": i, "text": s.text, "finish_reason": s.finish_reason,
                "logprobs": completion_logprobs(tok, s.logprobs) if want_logprobs else None, **extras(s)}
               for i, s in enumerate(states)]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(states)}


def completion_chunk(rid: str, model: str, index: int, ev: GenEvent, state: GenState, tok: Tokenizer,
                     want_logprobs: bool) -> dict:
    choice = {"index": index, "text": ev.text, "finish_reason": ev.finish_reason,
              "logprobs": completion_logprobs(tok, ev.logprobs, ev.text_offset)
              if want_logprobs else None}
    if ev.finish_reason is not None:
        choice.update(extras(state))
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": None}


def usage_chunk(rid: str, model: str, obj: str, states: list[GenState]) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(states)}


# ---- chat ----------------------------------------------------------------------------------
def chat_logprobs(tok: Tokenizer, entries: list[LogprobEntry]) -> dict:
    def item(token_id: int, lp: float) -> dict:
        text = tok.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}


def chat_completion(rid: str, model: str, state: GenState, tok: Tokenizer, want_logprobs: bool) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": state.text},
              "logprobs": chat_logprobs(tok, state.logprobs) if want_logprobs else None,
              "finish_reason": state.finish_reason, **extras(state)}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage([state])}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None, state: GenState | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None and state is not None:
        choice.update(extras(state))
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": None}
