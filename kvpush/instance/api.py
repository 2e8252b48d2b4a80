"""The OpenAI-compatible HTTP front end of one instance (aiohttp).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics. Every error is OpenAI's error JSON; bad input is a 4xx and never stops the server.
The handler of a client that disconnects is cancelled, which aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from aiohttp import web

from kvpush.config import Role, ServerConfig
from kvpush.engine.admission import ShedReason, decide
from kvpush.engine.prompt_check import check_prompt
from kvpush.engine.sampling_params import SamplingParams
from kvpush.errors import InvalidRequestError
from kvpush.instance import responses as R
from kvpush.instance import vllm_compat
from kvpush.instance.drain import Drain
from kvpush.instance.engine_client import EngineClient
from kvpush.instance.generation import EngineRequestError, Generator, GenEvent, GenState
from kvpush.instance.metrics import ServerMetrics
from kvpush.instance.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kvpush.models.tokenizer import Tokenizer
from kvpush.protocol import http as H
from kvpush.protocol.kv_params import KVInfo, RequestLegParams
from kvpush.protocol.trace import Trace

OPEN_PATHS = {"/health", "/metrics", "/v1/kv_info", "/query"}


class OpenAIServer:
    def __init__(self, config: ServerConfig, engine: EngineClient, tokenizer: Tokenizer, model_path: str) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or model_path
        self.accepted_names = {self.model_name, model_path}
        self.metrics = ServerMetrics(self.model_name)
        self.generator = Generator(engine, tokenizer, self.metrics)
        self.drain = Drain(engine, config.shutdown_timeout_s)
        self._ids = itertools.count()
        self.created = int(time.time())

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self.error_middleware, self.auth_middleware, self.drain_middleware],
                              client_max_size=8 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/kv_info", self.kv_info)
        app.router.add_get("/query", self.bootstrap_query)  # vllm-router --kv-connector mooncake asks this
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/emulation/reset_window", self.reset_emulation_window)
        return app

    # ---- middlewares ---------------------------------------------------------------------
    @web.middleware
    async def error_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except InvalidRequestError as e:
            return self._error(400, str(e), e.param)
        except EngineRequestError as e:
            if e.shed is not None:
                self.metrics.shed.labels(reason=e.shed).inc()
            return self._error(e.status, str(e), code=e.shed)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return self._error(e.status, e.reason or "error")

    @web.middleware
    async def auth_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        key = self.config.api_key
        if key and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return self._error(401, "invalid or missing API key")
        return await handler(request)

    @web.middleware
    async def drain_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Draining (SIGTERM): new requests get 503 with code "draining"; running ones are counted."""
        if request.method != "POST":
            return await handler(request)
        if self.drain.draining:
            return self._error(503, self.drain.reason, code="draining")
        self.drain.active += 1
        try:
            return await handler(request)
        finally:
            self.drain.active -= 1

    def _error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
        """An OpenAI error body; a 429 or 503 (overloaded, unavailable) says when to retry."""
        self.metrics.http_errors.labels(status=str(status)).inc()
        resp = H.error_response(status, message, param, code)
        if status in (429, 503):
            resp.headers["Retry-After"] = str(self.config.admission.retry_after_s)
        return resp

    # ---- simple routes -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.drain.draining:
            return self._error(503, self.drain.reason, code="draining")
        if not self.engine.healthy:
            return self._error(503, "engine is not running")
        return web.Response(text="ok")

    async def kv_info(self, request: web.Request) -> web.Response:
        """What the proxy needs to pair this instance with its peers."""
        info = self.engine.info
        if info is None:
            return self._error(503, "engine is not running")
        host, _, port = (info.kv_address or ":0").rpartition(":")
        return H.json_response(KVInfo(info.engine_id, info.role, info.kv_mode, host or None, int(port) or None,
                                      info.block_size, info.max_model_len, draining=self.drain.draining))

    async def bootstrap_query(self, request: web.Request) -> web.Response:
        """A Mooncake-style bootstrap answer (engine id per data-parallel rank; kvpush has rank 0)."""
        info = self.engine.info
        if info is None or info.role != "prefill":
            return self._error(404 if info else 503, "only a running prefill instance answers /query")
        return H.json_response({"0": {"engine_id": info.engine_id}})

    async def models(self, request: web.Request) -> web.Response:
        info = self.engine.info
        return H.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvpush",
            "max_model_len": info.max_model_len if info else None}]})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        self.metrics.update_engine(self.engine.stats, self.engine.num_in_flight)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache (as vLLM's): the engine forgets its cached prefix blocks before any
        request sent after this one; a benchmark's next run starts cold. 503 while the engine is down."""
        if not self.engine.healthy:
            return self._error(503, "the engine is not running")
        self.engine.reset_prefix_cache()
        return web.json_response({"reset": True})

    async def reset_emulation_window(self, request: web.Request) -> web.Response:
        """POST /emulation/reset_window (--emulate): the lateness percentiles on /metrics start afresh, before
        any request sent after this one (emulate/lateness.py); `kvpush bench` sends it before each run. 404 on
        a real instance, 503 while the engine is down."""
        if not self.engine.healthy:
            return self._error(503, "the engine is not running")
        if self.engine.info is None or self.engine.info.emulated_profile is None:
            return self._error(404, "this instance is not emulated (no --emulate): it has no lateness window",
                               code="not_emulated")
        self.engine.reset_emulation_window()
        return web.json_response({"reset": True, "profile": self.engine.info.emulated_profile})

    # ---- admission -----------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise web.HTTPNotFound(reason=f"model {model!r} does not exist; this server serves {self.model_name!r}")

    def _admit(self, ids: list[list[int]], kv: RequestLegParams | None) -> None:
        """Admission control (engine/admission.py), decided here within milliseconds whatever the engine
        is doing. A shed leg's peer is told through the engine core (D: Abort to P)."""
        if not self.engine.healthy or self.engine.info is None:
            raise EngineRequestError("engine is not running", 503, ShedReason.UNAVAILABLE.value)
        shed = decide(self.config.admission, self.engine.load(), [len(p) for p in ids], self.engine.info.block_size)
        if shed is not None:
            if kv is not None:
                self.engine.refuse(kv)
            raise EngineRequestError(shed.message, shed.status, shed.reason.value)

    def _check_prompt(self, ids: list[int], params: SamplingParams, explicit_max: bool) -> SamplingParams:
        info = self.engine.info
        assert info is not None
        check_prompt(ids, info.max_model_len, info.vocab_size, info.num_blocks, info.block_size)
        room = info.max_model_len - len(ids)
        if explicit_max and params.max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {info.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and max_tokens is {params.max_tokens}", param="max_tokens")
        return params

    @property
    def _role(self) -> str:
        return self.engine.info.role if self.engine.info else "colocated"

    async def _leg_params(self, body: CompletionRequest | ChatCompletionRequest,
                          num_prompts: int) -> tuple[RequestLegParams | None, bool]:
        """The request's leg parameters, typed, and whether they came in vLLM's shape (routers built for
        vLLM; translated to kvpush's own, and the response goes back in vLLM's shape)."""
        if not vllm_compat.is_vllm_shaped(body.kv_transfer_params):
            return body.leg_params(), False
        if (info := self.engine.info) is None:
            raise EngineRequestError("engine is not running", 503)
        kv = await vllm_compat.resolve_bootstrap(body.kv_transfer_params)
        return vllm_compat.translate_request(kv, info.role, info.kv_mode, num_prompts, body.stream), True

    def _streams(self, body: CompletionRequest | ChatCompletionRequest) -> bool:
        """A prefill leg's answer (its PrefillResult) is one JSON body, whatever `stream` says: the proxy
        sends P the client's body unchanged, so that P validates it exactly as D and a colocated instance do."""
        return body.stream and self.config.role is not Role.PREFILL

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(self._ids)}"

    # ---- completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        body = parse_body(await request.read(), CompletionRequest)
        self._check_model(body.model)
        prompts = body.prompts()
        kv, vllm = await self._leg_params(body, len(prompts))
        params = body.sampling_params(16, body.logprobs)
        if body.kv_transfer_params is not None and len(prompts) > 1:
            raise InvalidRequestError("kv_transfer_params names one transfer: send one prompt per request "
                                      "(the proxy splits batched prompts)", param="prompt")
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        for p in ids:
            self._check_prompt(p, params, body.max_tokens is not None)
        self._admit(ids, kv)
        rid = self._new_id("cmpl")
        states = [GenState(f"{rid}-{i}", p, stamps=Trace(api_received=received)) for i, p in enumerate(ids)]
        for s in states:
            self.generator.submit(s, params, kv)
        try:
            return await self._completions(request, body, rid, states, params, kv, vllm)
        finally:
            self.generator.release(states)

    async def _completions(self, request: web.Request, body: CompletionRequest, rid: str, states: list[GenState],
                           params: SamplingParams, kv: RequestLegParams | None,
                           vllm: bool) -> web.StreamResponse:
        want_lp = body.logprobs is not None
        if not self._streams(body):
            await asyncio.gather(*(self.generator.run(s, params, kv) for s in states))
            _stamp(states, "api_answered")
            out = R.completion(rid, self.model_name, states, self.tokenizer, want_lp)
            return H.json_response(vllm_compat.vllm_response(out, self._role) if vllm else out)
        stream = LazyStream(request)
        try:
            async with aclosing(self._merge(states, params, kv)) as events:
                async for i, ev in events:
                    chunk = R.completion_chunk(rid, self.model_name, i, ev, states[i], self.tokenizer, want_lp)
                    _stamp(states[i : i + 1], "api_first_chunk")
                    await stream.write(chunk)
        except EngineRequestError as e:
            return await stream.fail(e)
        except ConnectionResetError:
            return stream.gone()
        return await self._end_stream(stream, rid, "text_completion", states, body.include_usage)

    async def _merge(self, states: list[GenState], params: SamplingParams,
                     kv: RequestLegParams | None) -> AsyncGenerator[tuple[int, GenEvent], None]:
        if len(states) == 1:
            async with aclosing(self.generator.stream(states[0], params, kv)) as events:
                async for ev in events:
                    yield 0, ev
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with aclosing(self.generator.stream(states[i], params, kv)) as events:
                    async for ev in events:
                        await queue.put((i, ev))
            except EngineRequestError as e:
                await queue.put((i, e))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(states))]
        try:
            for _ in range(len(states)):
                while (item := await queue.get())[1] is not None:
                    if isinstance(item[1], EngineRequestError):
                        raise item[1]
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _end_stream(self, stream: LazyStream, rid: str, obj: str, states: list[GenState],
                          include_usage: bool) -> web.StreamResponse:
        if include_usage:
            await stream.write(R.usage_chunk(rid, self.model_name, obj, states))
        return await stream.close()

    # ---- chat ----------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        body = parse_body(await request.read(), ChatCompletionRequest)
        self._check_model(body.model)
        kv, vllm = await self._leg_params(body, 1)
        text = self.tokenizer.apply_chat_template(body.message_dicts(), add_generation_prompt=body.add_generation_prompt)
        ids = self.tokenizer.encode(text)
        info = self.engine.info
        max_tokens = body.max_completion_tokens or body.max_tokens
        default = max(1, (info.max_model_len if info else 1) - len(ids))
        body.max_tokens = max_tokens
        params = self._check_prompt(ids, body.sampling_params(default, body.chat_logprobs()), max_tokens is not None)
        self._admit([ids], kv)
        rid = self._new_id("chatcmpl")
        state = GenState(rid, ids, stamps=Trace(api_received=received))
        self.generator.submit(state, params, kv)
        try:
            return await self._chat(request, body, rid, state, params, kv, vllm)
        finally:
            self.generator.release([state])

    async def _chat(self, request: web.Request, body: ChatCompletionRequest, rid: str, state: GenState,
                    params: SamplingParams, kv: RequestLegParams | None, vllm: bool) -> web.StreamResponse:
        want_lp = body.logprobs
        if not self._streams(body):
            await self.generator.run(state, params, kv)
            _stamp([state], "api_answered")
            out = R.chat_completion(rid, self.model_name, state, self.tokenizer, want_lp)
            return H.json_response(vllm_compat.vllm_response(out, self._role) if vllm else out)
        stream = LazyStream(request, R.chat_chunk(rid, self.model_name, {"role": "assistant", "content": ""}))
        try:
            async with aclosing(self.generator.stream(state, params, kv)) as events:
                async for ev in events:
                    lp = R.chat_logprobs(self.tokenizer, ev.logprobs) if want_lp else None
                    delta = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
                    chunk = R.chat_chunk(rid, self.model_name, delta, ev.finish_reason, lp, state)
                    _stamp([state], "api_first_chunk")
                    await stream.write(chunk)
        except EngineRequestError as e:
            return await stream.fail(e)
        except ConnectionResetError:
            return stream.gone()
        return await self._end_stream(stream, rid, "chat.completion.chunk", [state], body.include_usage)


def _stamp(states: list[GenState], name: str) -> None:
    """Trace timestamp of the API process (the first one of each name counts); a chunk's stamp is
    taken just before it is written (after the write the client may already hold it)."""
    now = time.time()
    for s in states:
        s.stamps.set_once(name, now)


class LazyStream:
    """An SSE response whose headers go out with the first event, so that a request failing before
    its first token still gets a plain HTTP error status (which a proxy can act on)."""

    def __init__(self, request: web.Request, first_event: dict | None = None) -> None:
        self.request = request
        self.first_event = first_event
        self.resp: web.StreamResponse | None = None

    async def _start(self) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(self.request)
        if self.first_event is not None:
            await resp.write(H.sse(self.first_event))
        self.resp = resp
        return resp

    async def write(self, event: dict) -> None:
        resp = self.resp or await self._start()
        await resp.write(H.sse(event))

    async def fail(self, error: EngineRequestError) -> web.StreamResponse:
        if self.resp is None:
            raise error  # nothing sent yet: the error middleware answers with its status
        await self.resp.write(H.sse(H.error_body(error.status, str(error))))
        await self.resp.write(H.SSE_DONE)
        await self.resp.write_eof()
        return self.resp

    def gone(self) -> web.StreamResponse:
        """The client went away mid-stream; its engine requests were aborted on the way out."""
        return self.resp or web.Response(status=499)

    async def close(self) -> web.StreamResponse:
        resp = self.resp or await self._start()
        await resp.write(H.SSE_DONE)
        await resp.write_eof()
        return resp
