"""The engine-core process: owns the engine and runs its step loop; never does HTTP work.

Lifecycle: STARTING (load model) -> READY (CoreReady sent) -> RUNNING (step loop)
           -> STOPPED (Shutdown received, or the API process went away: EOF on the input pipe).
A failure to start is reported as CoreFailed with the reason, then the process exits.

The loop drains its input pipe without blocking while there is work, steps the engine, and sends
one StepOutputs per step. With nothing to do it sleeps in `wait()` on the input pipe and on a
wake-up pipe that other threads of this process (the KV transfer thread) write to. Once idle for
IDLE_TRIM_S after a step, it returns the heap's free pages to the OS (native_memory.py).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from kvpush.config import AdmissionConfig, EngineConfig, Role, TransferConfig
from kvpush.engine.admission import Load, decide
from kvpush.engine.engine import EngineOutput, LLMEngine
from kvpush.engine.native_memory import IdleTrimmer
from kvpush.errors import InvalidRequestError, KVPushError
from kvpush.instance import messages as m

if TYPE_CHECKING:  # imported when a role needs it (build_engine): colocated never loads nixl
    from kvpush.transfer.runtime import RuntimeConnector

log = logging.getLogger("kvpush.engine_core")
IDLE_WAIT_S = 1.0
IDLE_TRIM_S = 5.0  # idle this long after a step, the core hands freed heap memory back (native_memory.py);
# a prefill right after a trim faults its activations in again: +2.8% [1.6, 4.3] on a 512-token prefill (bench
# preset, `benchmarks/engine_ab.py --a trim=off --b trim=on --workloads prefill512 --repeats 12`), so the wait
# is long enough that requests at 1 req/s rarely follow a trim (0.5%)
STATS_INTERVAL_S = 0.05


class Waker:
    """A self-pipe: any thread calls wake(); the step loop waits on `fd`."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass  # already signalled

    def clear(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass


class EngineCore:
    def __init__(self, engine: LLMEngine, conn_in: Connection, conn_out: Connection, waker: Waker,
                 connector: RuntimeConnector | None = None, admission: AdmissionConfig | None = None) -> None:
        self.engine = engine
        self.connector = connector
        self.admission = admission or AdmissionConfig()
        self.num_added = 0
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.waker = waker
        self.stopped = False
        self.last_stats = 0.0
        self.last_key: tuple[int, ...] = ()
        self.trimmer = IdleTrimmer(IDLE_TRIM_S)

    def run(self) -> None:
        self._send([])  # the first stats, before any wait: /metrics is complete from the start
        while not self.stopped:
            busy = self.engine.has_unfinished()
            self._drain(0.0 if busy else IDLE_WAIT_S)
            if self.stopped:
                break
            if self.engine.has_unfinished():
                outputs = self.engine.step()
                self.trimmer.worked()
            else:
                outputs = []
                self.trimmer.idle()
            self._send(outputs)
            if not outputs and self.engine.has_unfinished() and not self._runnable():
                self._drain(0.05)  # only remote-KV requests: sleep until a wake-up or an input

    def _runnable(self) -> bool:
        s = self.engine.scheduler
        return bool(s.waiting or s.running or self.engine.finished)

    def _drain(self, timeout: float) -> None:
        ready = wait([self.conn_in, self.waker.fd], timeout)
        if self.waker.fd in ready:
            self.waker.clear()
        while self.conn_in.poll():
            try:
                msg = m.to_core_decoder.decode(self.conn_in.recv_bytes())
            except EOFError:
                self.stopped = True
                return
            self.handle(msg)

    def handle(self, msg: m.ToCore) -> None:
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.AbortRequest):
            self.engine.abort_request(msg.request_id)
        elif isinstance(msg, m.RefuseLeg):
            if self.connector is not None:
                self.connector.refuse(msg.kv_transfer_params)
        elif isinstance(msg, m.ResetPrefixCache):
            n = self.engine.block_manager.reset_prefix_cache()
            log.info("prefix cache reset: %d cached blocks forgotten", n)
        elif isinstance(msg, m.ResetEmulationWindow):
            self.engine.reset_emulation_window()
            self.last_key = ()  # the API's /metrics shows the empty window at once
        elif isinstance(msg, m.Shutdown):
            self.stopped = True

    def _add(self, msg: m.AddRequest) -> None:
        """Admission on the core's exact state (the API decided on its last stats): a request past the
        bounds is refused here, so that the engine's own queue is bounded too."""
        self.num_added += 1
        shed = decide(self.admission, self.load(), [len(msg.prompt_token_ids)], self.engine.block_manager.block_size)
        if shed is not None:
            if self.connector is not None and msg.kv_transfer_params is not None:
                self.connector.refuse(msg.kv_transfer_params)
            self._fail(msg.request_id, shed.message, shed.status, shed.reason.value)
            return
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                                    msg.kv_transfer_params)
        except InvalidRequestError as e:
            self._fail(msg.request_id, str(e), 400)

    def _fail(self, request_id: str, error: str, status: int, shed: str | None = None) -> None:
        delta = m.RequestDelta(request_id, [], finish_reason="error", error=error, error_status=status, shed=shed)
        self.conn_out.send_bytes(m.encode(m.StepOutputs([delta])))

    def load(self) -> Load:
        s, bm = self.engine.scheduler, self.engine.block_manager
        beyond_batch = len(s.waiting) + len(s.running) - s.config.max_num_seqs
        return Load(num_waiting=max(0, beyond_batch), waiting_tokens=s.num_waiting_tokens(), num_running=len(s.running),
                    free_blocks=bm.num_free_blocks, reserved_blocks=s.num_blocks_to_start(),
                    total_blocks=bm.num_blocks)

    def _send(self, outputs: list[EngineOutput]) -> None:
        now = time.monotonic()
        stats = None
        key = self._stats_key()
        if outputs or key != self.last_key or now - self.last_stats > STATS_INTERVAL_S:
            stats, self.last_stats, self.last_key = self.stats(), now, key
        if outputs or stats is not None:
            deltas = [to_delta(o) for o in outputs]
            self._stamp_first(outputs)
            self.conn_out.send_bytes(m.encode(m.StepOutputs(deltas, stats)))

    def _stamp_first(self, outputs: list[EngineOutput]) -> None:
        """Trace: when a request's first token left the engine core (`core_sent`)."""
        now = time.time()
        for o in outputs:
            request = self.engine.scheduler.requests.get(o.request_id)
            if request is not None and o.new_token_ids and request.trace.core_sent is None:
                request.trace.core_sent = now

    def _stats_key(self) -> tuple[int, ...]:
        """Cheap summary of the state /metrics shows: stats go out at once when it changes."""
        s = self.engine.scheduler
        return (len(s.running), len(s.waiting), len(s.remote), self.engine.block_manager.num_free_blocks,
                self.num_added)

    def stats(self) -> m.EngineStats:
        s, bm = self.engine.scheduler, self.engine.block_manager
        return m.EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_for_kv=len(s.remote),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_preemptions=sum(r.num_preemptions for r in s.requests.values()),
            prefix_cache_queries=bm.num_queries,
            prefix_cache_hits=bm.num_hits,
            steps=self.engine.step_count,
            compiled_graphs=self.engine.runner.num_compiled_graphs,
            num_added=self.num_added,
            kv_reserved_blocks=s.num_blocks_to_start(),
            transfer=self.connector.stats() if self.connector is not None else None,
            emulation=self.engine.emulation_stats(),
        )


def to_delta(o: EngineOutput) -> m.RequestDelta:
    return m.RequestDelta(
        request_id=o.request_id,
        new_token_ids=o.new_token_ids,
        logprobs=[m.LogprobEntry(lp.token_id, lp.logprob, lp.top) for lp in o.new_logprobs],
        finish_reason=o.finish_reason,
        num_prompt_tokens=o.num_prompt_tokens,
        num_cached_tokens=o.num_cached_tokens,
        error=o.error,
        error_status=429 if o.shed else 502 if o.error and o.error.startswith("KV transfer") else 500,
        shed=o.shed,
        kv_transfer_params=o.kv_transfer_params,
        trace=o.trace,
    )


def build_engine(config: EngineConfig, role: Role, transfer: TransferConfig,
                 waker: Waker) -> tuple[LLMEngine, RuntimeConnector | None]:
    """The engine of a role: colocated has no connector; prefill and decode get theirs."""
    engine = LLMEngine(config)
    if role is Role.COLOCATED:
        return engine, None
    from kvpush.transfer.decode_connector import DecodeConnector
    from kvpush.transfer.prefill_connector import PrefillConnector
    from kvpush.transfer.runtime import TransferRuntime

    runtime = TransferRuntime(role, transfer, engine.cache.kv, engine.cache.layout, config.model.model,
                              str(engine.dtype), waker.wake, kv_origin=engine.kv_origin)
    connector: RuntimeConnector = (PrefillConnector(runtime, transfer) if role is Role.PREFILL
                                   else DecodeConnector(runtime, transfer))
    engine.set_connector(connector)
    runtime.start()
    return engine, connector


def run_engine_core(config: EngineConfig, conn_in: Connection, conn_out: Connection,
                    role: Role = Role.COLOCATED, transfer: TransferConfig | None = None,
                    admission: AdmissionConfig | None = None) -> None:
    """Entry point of the spawned engine-core process."""
    # The API process owns the lifecycle (drain on SIGTERM, then Shutdown; EOF if it dies): a signal
    # sent to the whole process group (Ctrl-C, kill -TERM -PGID) must not end the core mid-drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    waker = Waker()
    try:
        engine, connector = build_engine(config, role, transfer or TransferConfig(), waker)
    except (KVPushError, OSError) as e:
        conn_out.send_bytes(m.encode(m.CoreFailed(f"{type(e).__name__}: {e}")))
        return
    ready = m.CoreReady(engine.max_model_len, engine.arch.vocab_size, engine.layout.num_blocks,
                        engine.layout.block_size, kv_address=connector.kv_address if connector else None,
                        engine_id=connector.engine_id if connector else "", role=role.value,
                        kv_mode=transfer.kv_mode.value if connector and transfer else None,
                        emulated_profile=engine.profile.name if engine.profile is not None else None)
    conn_out.send_bytes(m.encode(ready))
    core = EngineCore(engine, conn_in, conn_out, waker, connector, admission)
    try:
        core.run()
    except (BrokenPipeError, EOFError):
        pass  # the API process is gone
    finally:
        if connector is not None:
            connector.shutdown()
