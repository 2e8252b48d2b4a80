"""Offline Python API, in the manner of vLLM's:

    from kvpush import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    outputs[0].token_ids, outputs[0].text
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from kvpush.config import (
    CacheConfig,
    CompileMode,
    EmulationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_decode_attention,
    parse_linear_backend,
    parse_prefill_attention,
)
from kvpush.engine.engine import LLMEngine
from kvpush.engine.request import RequestStatus
from kvpush.engine.sampling_params import SamplingParams, TokenLogprob
from kvpush.errors import InvalidRequestError
from kvpush.models.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0


def build_engine_config(model: str, **kwargs) -> EngineConfig:
    """EngineConfig from flat keyword arguments (dtype=, block_size=, max_num_seqs=, compile=,
    linear_backend="auto" | "mkl" | "onednn", decode_attention= / prefill_attention="auto" | "kernel" | "sdpa", emulate=PROFILE, time_scale=S, ...)."""
    groups = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}  # type: ignore[var-annotated]
    top = {}
    emulation: dict = {}
    for key, value in kwargs.items():
        owner = next((cls for cls in groups if key in {f.name for f in fields(cls)}), None)
        if owner is not None:
            groups[owner][key] = value
        elif key in ("torch_threads", "seed"):
            top[key] = value
        elif key == "compile":
            top[key] = CompileMode(value)
        elif key == "linear_backend":
            top[key] = parse_linear_backend(value)
        elif key == "decode_attention":
            top[key] = parse_decode_attention(value)
        elif key == "prefill_attention":
            top[key] = parse_prefill_attention(value)
        elif key in ("emulate", "time_scale"):
            emulation[{"emulate": "profile"}.get(key, key)] = value
        else:
            raise TypeError(f"unknown engine option {key!r}")
    return EngineConfig(
        model=ModelConfig(model=model, **groups[ModelConfig]),
        cache=CacheConfig(**groups[CacheConfig]),
        scheduler=SchedulerConfig(**groups[SchedulerConfig]),
        emulation=EmulationConfig(**emulation),
        **top,
    )


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(build_engine_config(model, **kwargs))
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.engine.eos_token_ids |= set(self.tokenizer.eos_token_ids)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch. Returns outputs in prompt order.

        Raises InvalidRequestError (before anything runs) if any prompt or parameter is invalid.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompt_list]
        for ids, sp in zip(token_lists, params, strict=True):
            self.engine.validate(ids, sp)
        results: dict[str, RequestOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        for ids, sp in zip(token_lists, params, strict=True):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, sp)
            results[rid] = RequestOutput(rid, ids)
            detoks[rid] = IncrementalDetokenizer(self.tokenizer, list(sp.stop))
        while self.engine.has_unfinished():
            for out in self.engine.step():
                self._apply(results[out.request_id], detoks[out.request_id], out)
        return list(results.values())

    def _apply(self, result: RequestOutput, detok: IncrementalDetokenizer, out) -> None:
        if result.finish_reason is not None:
            return
        result.token_ids.extend(out.new_token_ids)
        result.logprobs.extend(out.new_logprobs)
        result.num_cached_tokens = out.num_cached_tokens
        delta, stopped = detok.update(out.new_token_ids)
        result.text += delta
        if stopped:
            result.finish_reason = "stop"
            self.engine.abort_request(result.request_id, RequestStatus.FINISHED_STOPPED)
        elif out.finish_reason is not None:
            result.text += detok.flush()
            result.finish_reason = out.finish_reason


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
