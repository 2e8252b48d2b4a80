"""What both role sides of the transfer thread share: the agent, the ledger, the metrics, the
event sink, and the whole-request transfers this instance posted (P's WRITEs, D's READs).

A posted transfer is polled to its end whatever happens to its record meanwhile: a record that
fails while its transfer is in flight is not confirmed free of in-flight data until it ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvpush.transfer.events import Event
from kvpush.transfer.kv_agent import KVAgent, Transfer, XferStatus
from kvpush.transfer.ledger import LedgerError, TransferLedger, TransferRecord
from kvpush.transfer.records import FailureKind
from kvpush.transfer.stats import TransferMetrics


class Posted:
    def __init__(self, agent: KVAgent, ledger: TransferLedger, metrics: TransferMetrics,
                 emit: Callable[[Event], None], block_size: int) -> None:
        self.agent = agent
        self.ledger = ledger
        self.metrics = metrics
        self.emit = emit
        self.block_size = block_size
        self.transfers: dict[str, Transfer] = {}

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self.transfers

    def __bool__(self) -> bool:
        return bool(self.transfers)

    def track(self, rec: TransferRecord, transfer: Transfer) -> str | None:
        """Record a posted transfer (MATCHED -> POSTED). Returns why the record must fail, if so
        (e.g. the deadline passed during a slow synchronous post); the transfer is tracked anyway."""
        self.transfers[rec.transfer_id] = transfer
        try:
            self.ledger.mark_posted(rec.transfer_id, num_descs=transfer.num_descs, num_bytes=transfer.num_bytes)
        except LedgerError as e:
            return f"posted too late: {e}"
        return None

    def live_peers(self) -> Counter[str]:
        """Peers of our transfers in flight, with how many each, leaving out a transfer that outlived
        its record (failed or expired while in flight: it may never end, and nothing waits for it)."""
        return Counter(t.peer for tid, t in self.transfers.items()
                       if (rec := self.ledger.get(tid)) is not None and not rec.is_terminal)

    def poll(self) -> list[tuple[str, Transfer, XferStatus]]:
        """Transfers that ended since the last call (released), with how they ended."""
        ended: list[tuple[str, Transfer, XferStatus]] = []
        for tid, transfer in list(self.transfers.items()):
            state = self.agent.poll(transfer)
            if state is XferStatus.POSTED:
                continue
            del self.transfers[tid]
            self.agent.release(transfer)
            ended.append((tid, transfer, state))
        return ended

    def mark_failed(self, rec: TransferRecord, reason: str, confirmed: bool = False,
                    kind: FailureKind = FailureKind.ERROR) -> TransferRecord:
        """FAILED; `confirmed` (nothing in flight) only holds if no transfer of ours is. A transfer of
        ours in flight is recorded as posted even when `mark_posted` refused it (posted too late), so
        that no peer message releases D's blocks before it ends."""
        in_flight = rec.transfer_id in self.transfers
        return self.ledger.mark_failed(rec.transfer_id, reason, confirmed=confirmed and not in_flight,
                                       posted=in_flight, kind=kind)
