"""The engine: admission checks, one scheduling + model step at a time, outputs.

    add_request -> WAITING -> (scheduled, computed, sampled each step) -> FINISHED_*
    abort_request at any time -> FINISHED_ABORTED, blocks freed at once.

Single-threaded: the owner (the offline LLM or the engine-core process) calls every method from
one thread. A KV connector (prefill/decode roles) hooks admission and step boundaries.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace

import msgspec
import torch

from kvpush.bench import machine
from kvpush.config import (
    EngineConfig,
    SchedulerConfig,
    apply_compile_environment,
    apply_native_cache_environment,
)
from kvpush.emulate.lateness import EmulationStats
from kvpush.emulate.profile import load_profile
from kvpush.emulate.runner import EmulatedRunner
from kvpush.emulate.setup import emulated_arch, emulated_runner
from kvpush.engine.attention_choice import AttentionChoice
from kvpush.engine.attention_choice import choose_for as choose_attention
from kvpush.engine.block_manager import BlockManager
from kvpush.engine.device import resolve_device
from kvpush.engine.kv_cache import KVCache, KVLayout
from kvpush.engine.kv_connector import EngineHooks, KVConnector
from kvpush.engine.linear_choice import Choice, choose_for
from kvpush.engine.model_runner import ModelRunner, StepRunner
from kvpush.engine.prompt_check import check_prompt
from kvpush.engine.request import Request, RequestStatus
from kvpush.engine.sampling_params import SamplingParams, TokenLogprob
from kvpush.engine.scheduler import Scheduler
from kvpush.errors import InvalidRequestError
from kvpush.layers.cpu_kernels import PagedDecode, PrefillAttention
from kvpush.models.loader import load_model
from kvpush.protocol.kv_params import PrefillResult, RequestLegParams
from kvpush.protocol.trace import Trace

log = logging.getLogger(__name__)

@dataclass
class EngineOutput:
    """What one step produced for one request: new tokens, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    shed: str | None = None  # why the request was refused for lack of capacity (engine/admission.py)
    kv_transfer_params: PrefillResult | None = None  # P's answer for the proxy
    trace: Trace | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None) -> None:
        self.config = config
        apply_native_cache_environment()  # before the first oneDNN operation
        # Before anything imports inductor's config, which fixes its cache directory at import (building the
        # meta-device model whose shapes the linear backend's calibration times does).
        apply_compile_environment()
        torch.set_num_threads(config.torch_threads)
        self.device = resolve_device(config.model.device)  # DeviceError: e.g. cuda on a machine without
        # --emulate: no weights; the profile's KV geometry and clock, the checkpoint's vocabulary (kvpush/emulate/)
        self.profile = load_profile(config.emulation.profile) if config.emulation.profile else None
        if self.profile is None:
            self._load_model(config)
        else:
            self.arch, self.dtype = emulated_arch(config.model.model, self.profile)
        self.max_model_len = min(config.model.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.layout = self._layout()
        self.cache = KVCache(self.layout, self.device)
        self.block_manager = BlockManager(self.layout.num_blocks, self.layout.block_size,
                                          config.cache.enable_prefix_caching)
        # an emulated accelerator schedules as its kind does (a GPU profile packs prefills, as vLLM)
        self.accelerator = torch.device(self.profile.device) if self.profile is not None else self.device
        self.scheduler = Scheduler(_by_device(config.scheduler, self.accelerator), self.block_manager,
                                   self.max_model_len)
        self.eos_token_ids = set(self.arch.eos_token_ids) | _generation_eos(config.model.model)
        self.runner: StepRunner = (
            ModelRunner(self.model, self.cache, self.device, config.seed, config.compile,
                        *self._attention(config)) if self.profile is None
            else emulated_runner(self.cache, self.profile, config.emulation.time_scale, config.model.model,
                                 self.arch.vocab_size, self.eos_token_ids, self.max_model_len))
        self.finished: list[EngineOutput] = []
        self.step_count = 0
        self.connector: KVConnector | None = None
        if connector is not None:
            self.set_connector(connector)

    @property
    def kv_origin(self) -> str:
        """What computed this instance's KV, for the compatibility hash: "" (the model) or the emulation's
        profile, so that a real instance never pairs with an emulated one."""
        p = self.profile
        return "" if p is None else f"emulated:{p.name}:{p.fingerprint}:x{self.config.emulation.time_scale:g}"

    def emulation_stats(self) -> EmulationStats | None:
        return self.runner.stats() if isinstance(self.runner, EmulatedRunner) else None

    def reset_emulation_window(self) -> None:
        """Start the lateness window afresh (emulate/lateness.py); nothing on a real engine."""
        if isinstance(self.runner, EmulatedRunner):
            self.runner.lateness.reset_window()

    def _load_model(self, config: EngineConfig) -> None:
        self.linear_choice: Choice = choose_for(config, self.device, machine.cpu())  # --linear-backend: calibrated or cached
        log.info("%s", self.linear_choice.line())
        self.model, self.arch, self.dtype = load_model(config.model.model, config.model.dtype, str(self.device),
                                                          huge_pages=config.model.huge_pages,
                                                          linear_backend=self.linear_choice.backend)

    def _attention(self, config: EngineConfig) -> tuple[PagedDecode | None, PrefillAttention | None]:
        """The decode and prefill kernels chosen (--decode-attention, --prefill-attention), or None (SDPA)."""
        args = (self.layout, self.arch.num_heads, self.device, machine.cpu())
        self.attention_choice: AttentionChoice = choose_attention(config.decode_attention, *args)
        self.prefill_choice: AttentionChoice = choose_attention(config.prefill_attention, *args, op="prefill")
        for choice in (self.attention_choice, self.prefill_choice):
            log.info("%s", choice.line())
        return self.attention_choice.kernel, self.prefill_choice.kernel

    def set_connector(self, connector: KVConnector) -> None:
        """Install the KV connector of a prefill or decode role (before any request)."""
        self.connector = connector
        self.scheduler.hold = connector.on_finished
        self.scheduler.chunk_limit = _long_prefill_limit(self.config.scheduler, self.accelerator, connector.decodes)
        connector.attach(EngineHooks(self.scheduler, self.block_manager, self.runner, self.cache, self.on_token))

    def _layout(self) -> KVLayout:
        cache_cfg, arch = self.config.cache, self.arch
        layout = KVLayout(1, arch.num_layers, cache_cfg.block_size, arch.num_kv_heads, arch.head_dim, self.dtype)
        num_blocks = cache_cfg.num_blocks or KVLayout.blocks_for_memory(
            cache_cfg.kv_cache_memory_mb << 20, layout.block_bytes)
        return KVLayout(num_blocks, arch.num_layers, cache_cfg.block_size, arch.num_kv_heads, arch.head_dim, self.dtype)

    # ---- admission -----------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if the request can never run on this engine."""
        check_prompt(prompt_token_ids, self.max_model_len, self.arch.vocab_size,
                     self.layout.num_blocks, self.layout.block_size)

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        self.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += sorted(self.eos_token_ids - set(stop_ids))
        params = msgspec.structs.replace(params, stop_token_ids=stop_ids)
        request = Request(request_id, list(prompt_token_ids), params)
        if params.seed is not None:
            request.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        return request

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: RequestLegParams | None = None) -> Request:
        """Queue a request. Raises InvalidRequestError (nothing queued) if it can never run here."""
        request = self.make_request(request_id, prompt_token_ids, params)
        request.trace.arrived = time.time()
        if self.connector is not None:
            self.connector.on_add(request, kv_transfer_params)
        elif kv_transfer_params is not None:
            raise InvalidRequestError("kv_transfer_params given to a colocated instance", param="kv_transfer_params")
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                      error: str | None = None) -> bool:
        """Finish a request early and free its blocks. False if it is unknown or already finished."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        request.error = error
        self.scheduler.finish(request, status)
        self.finished.append(self._output(request, []))
        return True

    # ---- stepping ------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        pending_events = self.connector is not None and self.connector.has_events()
        return self.scheduler.num_unfinished() > 0 or bool(self.finished) or pending_events

    def step(self) -> list[EngineOutput]:
        """Apply transfer events, schedule, run the model once, sample. Returns outputs of requests
        that progressed or ended. A step in which transfer events gave requests their first token
        (P's, from the KV handover) returns those at once, without a forward: they must not wait
        for the next decode step."""
        polled = self.connector.poll() if self.connector is not None else []
        outputs, self.finished = self.finished, []
        if polled:  # a token that came with remote KV (P's first token) goes out before the next forward
            return outputs + [self._last_output(r) for r in polled]
        out = self.scheduler.schedule(self.admission_hook())
        outputs += [self._output(r, []) for r in out.rejected]
        if out.empty:
            return outputs
        if self.connector is not None:
            self.connector.before_forward(out.scheduled)
        sampled = self.runner.execute(out.scheduled)
        self.step_count += 1
        for request in self.scheduler.update(out, sampled):
            self.on_token(request)
            outputs.append(self._last_output(request))
        return outputs

    def _last_output(self, request: Request) -> EngineOutput:
        """The output of a request that just got its newest token (or ended without one)."""
        if not request.output_token_ids:
            return self._output(request, [])
        want_lp = request.sampling_params.logprobs is not None and request.output_logprobs
        return self._output(request, request.output_token_ids[-1:], request.output_logprobs[-1:] if want_lp else [])

    def admission_hook(self):
        """The connector decides per waiting request whether it may be admitted now."""
        return self.connector.admit if self.connector is not None else None

    def on_token(self, request: Request) -> None:
        """Called after a request got a token (it may have finished)."""
        if request.num_output_tokens == 1:
            request.trace.first_token = time.time()

    def _output(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> EngineOutput:
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=list(tokens),
            new_logprobs=list(logprobs or []),
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            shed=request.shed,
            kv_transfer_params=self._kv_result(request),
            trace=msgspec.structs.replace(request.trace) if request.is_finished else None,
        )


    def _kv_result(self, request: Request) -> PrefillResult | None:
        return self.connector.result(request) if request.is_finished and self.connector is not None else None


# Prompt tokens a prefill may have to join a step that computes another one, on a CPU: about what one
# step's fixed cost is worth in prefill time (bench preset: a step ~4 ms, a prefill token ~0.22 ms).
# A GPU computes a few hundred tokens in about the time of one: there prefills pack (vLLM's default).
CPU_PREFILL_JOIN_TOKENS = 16


def _by_device(config: SchedulerConfig, device: torch.device) -> SchedulerConfig:
    """The scheduler's settings with `prefill_join_tokens` None resolved for the device."""
    if config.prefill_join_tokens is not None:
        return config
    return replace(config, prefill_join_tokens=CPU_PREFILL_JOIN_TOKENS if device.type == "cpu" else -1)


# A decode instance's prefill chunk on a CPU: about 4 decode steps' time (bench preset: ~0.22 ms a prompt token,
# so ~55 ms), the most a chunk holds back the requests decoding beside it; a step's fixed cost (~4 ms) per chunk
# is what it adds to the prefill. On a GPU a chunk of a few thousand tokens takes about a decode step: off.
CPU_LONG_PREFILL_TOKENS = 256


def _long_prefill_limit(config: SchedulerConfig, device: torch.device, decodes: bool) -> int:
    """The scheduler's chunk limit: long_prefill_token_threshold, or for None CPU_LONG_PREFILL_TOKENS on a
    decode instance (one whose connector takes KV from a peer) on a CPU, 0 (off) otherwise."""
    if config.long_prefill_token_threshold is not None:
        return config.long_prefill_token_threshold
    on = decodes and device.type == "cpu" and config.enable_chunked_prefill
    return CPU_LONG_PREFILL_TOKENS if on else 0


def _generation_eos(model_dir: str) -> set[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return set()
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return set()
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
