"""The API process's handle on the engine-core process.

Per request: add() -> a queue of RequestDelta, ended by a delta with finish_reason set ->
the request is forgotten. abort() tells the core; its final delta still arrives and is dropped.
If the core dies, every open queue gets an error delta and `healthy` turns False.

Threads: a reader thread blocks on the core's output pipe and hands each message to the event loop
with call_soon_threadsafe; everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
import time
from collections import deque
from multiprocessing.connection import Connection

from kvpush.config import EngineConfig
from kvpush.engine.admission import Load, blocks_for
from kvpush.errors import ModelLoadError
from kvpush.instance import messages as m
from kvpush.protocol.kv_params import DecodeLegParams, RequestLegParams

log = logging.getLogger("kvpush.engine_client")


class EngineClient:
    def __init__(self, config: EngineConfig, start_timeout_s: float = 300.0) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.queues: dict[str, asyncio.Queue[m.RequestDelta]] = {}
        self.first_received: dict[str, float] = {}  # trace: when the reader got a request's first token
        self.stats = m.EngineStats()
        self.info: m.CoreReady | None = None
        self.healthy = False
        self._proc: mp.process.BaseProcess | None = None
        self._to_core: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[m.CoreReady] | None = None
        # Admission's view between two stats: requests with no output token yet (prompt tokens), and
        # requests sent that the core had not taken in at its last stats (their blocks).
        self._pending: dict[str, int] = {}
        self.pending_tokens = 0
        self._num_sent = 0
        self._in_transit: deque[tuple[int, int]] = deque()  # (sequence number, blocks)
        self._in_transit_blocks = 0

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, target=None, extra_args: tuple = ()) -> m.CoreReady:
        """Spawn the core (`target`: kvpush.instance.engine_core.run_engine_core unless a test says otherwise)
        and wait until it has loaded the model. Raises ModelLoadError."""
        if target is None:  # this (API) process never imports torch; the spawned core does
            from kvpush.instance.core_entry import run_engine_core as target
        ctx = mp.get_context("spawn")
        core_in, self._to_core = ctx.Pipe(duplex=False)
        from_core, core_out = ctx.Pipe(duplex=False)
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._proc = ctx.Process(target=target, args=(self.config, core_in, core_out, *extra_args),
                                 name="kvpush-engine-core", daemon=True)
        self._proc.start()
        core_in.close()
        core_out.close()
        threading.Thread(target=self._read_loop, args=(from_core,), name="kvpush-core-reader", daemon=True).start()
        try:
            self.info = await asyncio.wait_for(self._ready, self.start_timeout_s)
        except TimeoutError as e:
            await self.shutdown()
            raise ModelLoadError(f"engine core did not start within {self.start_timeout_s} s") from e
        if self.stats.num_total_blocks == 0:  # admission's view until the core's first stats arrive
            self.stats = m.EngineStats(num_free_blocks=self.info.num_blocks, num_total_blocks=self.info.num_blocks)
        self.healthy = True
        return self.info

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self.healthy = False
        if self._to_core is not None:
            try:
                self._to_core.send_bytes(m.encode(m.Shutdown()))
            except (BrokenPipeError, OSError):
                pass
        proc = self._proc
        if proc is not None:
            await asyncio.to_thread(proc.join, timeout_s)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)

    # ---- requests ------------------------------------------------------------------------
    def add(self, request: m.AddRequest) -> asyncio.Queue[m.RequestDelta]:
        queue: asyncio.Queue[m.RequestDelta] = asyncio.Queue()
        if not self.healthy:
            queue.put_nowait(m.RequestDelta(request.request_id, [], finish_reason="error",
                                            error="engine is not running"))
            return queue
        self.queues[request.request_id] = queue
        n = len(request.prompt_token_ids)
        if not isinstance(request.kv_transfer_params, DecodeLegParams):  # a decode leg's prompt is P's work
            self._pending[request.request_id] = n
            self.pending_tokens += n
        self._num_sent += 1
        blocks = blocks_for(n, self.info.block_size) if self.info is not None else 0
        self._in_transit.append((self._num_sent, blocks))
        self._in_transit_blocks += blocks
        self._send(request)
        return queue

    def abort(self, request_id: str) -> None:
        self._unpend(request_id)
        if self.queues.pop(request_id, None) is not None:
            self._send(m.AbortRequest(request_id))

    def fail_all(self, reason: str, status: int) -> int:
        """End every open request now with an error (the handlers answer `status`, or an SSE error event
        once streaming) and abort them in the core (its connectors tell the peers). Returns how many."""
        open_ids = list(self.queues)
        for rid in open_ids:
            self.queues.pop(rid).put_nowait(m.RequestDelta(rid, [], finish_reason="error", error=reason,
                                                           error_status=status))
            self._send(m.AbortRequest(rid))
        return len(open_ids)

    def reset_prefix_cache(self) -> None:
        """The core forgets its cached prefix blocks before it takes any request sent after this."""
        self._send(m.ResetPrefixCache())

    def reset_emulation_window(self) -> None:
        """--emulate: the core starts its lateness window afresh before it takes any request sent after this."""
        self._send(m.ResetEmulationWindow())

    def refuse(self, kv_transfer_params: RequestLegParams) -> None:
        """A leg was shed before it reached the engine: the core's KV connector tells the peer."""
        if self.healthy:
            self._send(m.RefuseLeg(kv_transfer_params))

    def load(self) -> Load:
        """Admission's view of the engine: its last stats plus the requests sent since."""
        st, batch = self.stats, self.config.scheduler.max_num_seqs
        return Load(num_waiting=max(0, self.num_in_flight - st.num_waiting_for_kv - batch),
                    waiting_tokens=self.pending_tokens, num_running=st.num_running, free_blocks=st.num_free_blocks,
                    reserved_blocks=st.kv_reserved_blocks + self._in_transit_blocks,
                    total_blocks=st.num_total_blocks)

    def _unpend(self, request_id: str) -> None:
        self.pending_tokens -= self._pending.pop(request_id, 0)

    def _taken_in(self, num_added: int) -> None:
        """The core has taken in its first `num_added` requests: they are in its stats now."""
        while self._in_transit and self._in_transit[0][0] <= num_added:
            self._in_transit_blocks -= self._in_transit.popleft()[1]

    def _send(self, msg: m.ToCore) -> None:
        assert self._to_core is not None
        try:
            self._to_core.send_bytes(m.encode(msg))
        except (BrokenPipeError, OSError):
            self._core_died("engine core is gone")

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    # ---- reader --------------------------------------------------------------------------
    def _read_loop(self, conn: Connection) -> None:
        assert self._loop is not None
        while True:
            try:
                msg = m.from_core_decoder.decode(conn.recv_bytes())
            except (EOFError, OSError):
                self._post(self._core_died, "engine core exited")
                return
            self._post(self._dispatch, msg, time.time())

    def _post(self, fn, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: shutting down

    def _dispatch(self, msg: m.FromCore, received: float = 0.0) -> None:
        if isinstance(msg, m.StepOutputs):
            if msg.stats is not None:
                self.stats = msg.stats
                self._taken_in(msg.stats.num_added)
            for delta in msg.deltas:
                if delta.new_token_ids or delta.finish_reason is not None:
                    self._unpend(delta.request_id)
                queue = self.queues.get(delta.request_id)
                if queue is None:
                    continue
                if delta.new_token_ids:
                    self.first_received.setdefault(delta.request_id, received)
                queue.put_nowait(delta)
                if delta.finish_reason is not None:
                    del self.queues[delta.request_id]
        elif isinstance(msg, m.CoreReady):
            self._resolve_ready(msg)
        elif isinstance(msg, m.CoreFailed):
            self._core_died(msg.reason)

    def _resolve_ready(self, msg: m.CoreReady) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(msg)

    def _core_died(self, reason: str) -> None:
        self.healthy = False
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ModelLoadError(f"engine core failed to start: {reason}"))
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(m.RequestDelta(rid, [], finish_reason="error", error=reason))
        self.queues.clear()
        self._pending.clear()
        self.pending_tokens = 0
        if reason != "engine core exited":
            log.error("engine core: %s", reason)
