"""Layer-wise push on P: write each layer's KV of the blocks a prefill chunk completed, while the
forward pass goes on; commit when the whole prompt has landed.

Per transfer (all on the transfer thread):
    slices (block index, layer) become *finished* as the engine reports layers (LayersDone);
    once D's registration is known, finished slices in D's range are *posted*, never twice;
    after P's prefill ended (Hold) and every slice of D's range was posted and completed,
    the worker sends Commit and frees P's blocks.

Coalescing rule: in one poll of the transfer thread, all finished-but-unposted slices of a transfer
that share the same block set go out as ONE write over the run of their layers (nixl merges
kv[b, l..l+k], and whole blocks when all layers are included), so the number of WRITEs per poll is
at most the number of distinct chunks pending, and descriptors per WRITE at most the blocks of a chunk
(when layers are contiguous) - never blocks x layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.transfer.kv_agent import KVAgent, Transfer, XferStatus


def blocks_complete(end: int, num_prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks hold their whole KV once its first ``end`` tokens are computed: the
    full blocks, and the partial last one only when the prompt is done (the engine hands the writer the
    blocks past what it handed before, layer by layer, as each chunk's forward pass goes)."""
    end = min(end, num_prompt_tokens)
    return -(-end // block_size) if end == num_prompt_tokens else end // block_size


@dataclass
class LayerwiseTransfer:
    num_layers: int
    finished: dict[int, set[int]] = field(default_factory=dict)  # layer -> P block indices finished
    posted: dict[int, set[int]] = field(default_factory=dict)  # layer -> block indices already posted
    p_blocks: dict[int, int] = field(default_factory=dict)  # P block index -> P block id
    remote: list[int] | None = None  # D's block ids for indices skip, skip + 1, ...
    skip: int = 0
    peer: str | None = None
    prefill_done: bool = False
    in_flight: list[Transfer] = field(default_factory=list)
    num_bytes: int = 0
    num_descs: int = 0
    num_writes: int = 0
    failed: str | None = None

    def needed(self) -> range:
        return range(self.skip, self.skip + len(self.remote or []))

    def complete(self) -> bool:
        """Everything D needs was posted and has landed."""
        need = set(self.needed())
        return (self.prefill_done and self.remote is not None and not self.in_flight
                and all(need <= self.posted.get(layer, set()) for layer in range(self.num_layers)))


class LayerwiseWriter:
    def __init__(self, agent: KVAgent, num_layers: int) -> None:
        self.agent = agent
        self.num_layers = num_layers
        self.transfers: dict[str, LayerwiseTransfer] = {}

    def get(self, tid: str) -> LayerwiseTransfer:
        if tid not in self.transfers:
            self.transfers[tid] = LayerwiseTransfer(self.num_layers)
        return self.transfers[tid]

    def layers_done(self, tid: str, layer: int, indices: tuple[int, ...], block_ids: tuple[int, ...]) -> None:
        t = self.get(tid)
        t.finished.setdefault(layer, set()).update(indices)
        t.p_blocks.update(zip(indices, block_ids, strict=True))

    def registered(self, tid: str, peer: str, remote: list[int], skip: int) -> None:
        t = self.get(tid)
        t.peer, t.remote, t.skip = peer, list(remote), skip

    def in_flight(self, tid: str) -> bool:
        t = self.transfers.get(tid)
        return bool(t and t.in_flight)

    def post_ready(self, tid: str) -> int:
        """Post every finished, unposted slice D registered for; returns the number of WRITEs."""
        t = self.transfers.get(tid)
        if t is None or t.remote is None or t.peer is None or t.failed:
            return 0
        need = set(t.needed())
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer in range(self.num_layers):
            todo = tuple(sorted((t.finished.get(layer, set()) & need) - t.posted.get(layer, set())))
            if todo:
                groups.setdefault(todo, []).append(layer)
        for indices, layers in groups.items():
            local = [t.p_blocks[i] for i in indices]
            remote = [t.remote[i - t.skip] for i in indices]
            transfer = self.agent.write_layers(t.peer, local, remote, layers)
            t.in_flight.append(transfer)
            t.num_bytes += transfer.num_bytes
            t.num_descs += transfer.num_descs
            t.num_writes += 1
            for layer in layers:
                t.posted.setdefault(layer, set()).update(indices)
        return len(groups)

    def poll(self) -> list[str]:
        """Poll in-flight writes; returns transfers whose writes all ended (or one failed)."""
        settled = []
        for tid, t in self.transfers.items():
            if not t.in_flight:
                continue
            still = []
            for transfer in t.in_flight:
                state = self.agent.poll(transfer)
                if state is XferStatus.POSTED:
                    still.append(transfer)
                    continue
                self.agent.release(transfer)
                if state is XferStatus.FAILED:
                    t.failed = transfer.error or "layer write failed"
            t.in_flight = still
            if not still:
                settled.append(tid)
        return settled

    def drop(self, tid: str) -> None:
        self.transfers.pop(tid, None)
