"""Graceful shutdown of one instance (`kvpush serve`): drain, bounded by --shutdown-timeout.

    SERVING --SIGTERM/SIGINT--> DRAINING: the listener stays open; new completions get 503 (code
        "draining"), /health and /v1/kv_info say so (the proxy stops choosing the instance); running
        requests finish, and on P the transfers it handed over (blocks held for D) complete
    --(nothing left, or --shutdown-timeout passed, or a second signal)--> STOPPING: what is left ends
        with a 503 error (an SSE error event once streaming), its engine requests are aborted (D tells
        P with Abort), the core shuts down (every live transfer fails and its peer is told), exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import StrEnum

from kvpush.instance.engine_client import EngineClient
from kvpush.transfer.records import TransferState

log = logging.getLogger("kvpush.drain")
POLL_S = 0.05
FLUSH_S = 5.0  # after the timeout: how long the handlers get to write their errors


class DrainState(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"


class Drain:
    """The instance's drain state and what the HTTP front end asks of it."""

    def __init__(self, engine: EngineClient, timeout_s: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.state = DrainState.SERVING
        self.active = 0  # completion handlers running (admitted before the drain, or refused during it)

    @property
    def draining(self) -> bool:
        return self.state is not DrainState.SERVING

    @property
    def reason(self) -> str:
        return (f"this instance is draining (shutting down, --shutdown-timeout {self.timeout_s:g} s): it takes "
                f"no new requests; send them to another instance")

    def live_transfers(self) -> int:
        """Live ledger records (P: blocks held for a D that has not taken them yet)."""
        t = self.engine.stats.transfer
        if t is None:
            return 0
        return sum(n for state, n in t.by_state.items() if not TransferState(state).is_terminal)

    def idle(self) -> bool:
        return self.active == 0 and self.engine.num_in_flight == 0 and self.live_transfers() == 0

    async def run(self, again: asyncio.Event) -> None:
        """Drain until idle, the timeout, or `again` (a second signal); then end what is left."""
        self.state = DrainState.DRAINING
        start = time.monotonic()
        log.info("draining: %d requests in flight, %d live transfers; waiting up to %g s",
                 self.engine.num_in_flight, self.live_transfers(), self.timeout_s)
        deadline = start + self.timeout_s
        while not self.idle() and not again.is_set() and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(again.wait(), min(POLL_S, max(deadline - time.monotonic(), 0.0)))
            except TimeoutError:
                pass
        self.state = DrainState.STOPPING
        if self.idle():
            log.info("drained in %.2f s", time.monotonic() - start)
            return
        why = "a second signal" if again.is_set() else f"--shutdown-timeout {self.timeout_s:g} s passed"
        ended = self.engine.fail_all(f"the server shut down before this request finished ({why})", 503)
        log.warning("drain ended by %s: %d requests ended with an error, %d live transfers fail (peers told)",
                    why, ended, self.live_transfers())
        flush_deadline = time.monotonic() + FLUSH_S
        while self.active and time.monotonic() < flush_deadline:
            await asyncio.sleep(POLL_S)
