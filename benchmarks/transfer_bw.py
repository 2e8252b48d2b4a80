"""KV transfer bandwidth and per-transfer overhead: memcpy vs bare nixl vs kvpush's wrapper.

Two processes on this machine: the initiator (this process) WRITEs contiguous runs of blocks of
its block-major buffer ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
into the target's buffer with a notification; the target spins on notifications, stamps their
arrival with CLOCK_MONOTONIC (shared by all processes) and acknowledges each one so that the
initiator never overlaps two transfers. Per size (1, 8, 64, 512 blocks by default):

  (a) memcpy   in-process ``torch`` copy of the same bytes (1 intra-op thread; on a GPU a
               device-to-device copy, synchronized)
  (b) nixl     bare nixl: ``make_prepped_xfer`` on lists prepared with the runs already merged
               into one descriptor, ``transfer``, ``check_xfer_state`` until DONE, release
  (c) kvpush   ``NixlTransferAgent.write`` (per-block prepared lists, nixl merges) + ``poll``

Times for (b) and (c) run from just before the post to the notification's arrival at the target.
Overheads are the median time minus that of the column to the left (nixl vs memcpy, kvpush vs
nixl). The bare-nixl column uses the wrapper's agent object rather than importing nixl, which
stays confined to ``kvpush/transfer/nixl_agent.py``.

    python benchmarks/transfer_bw.py [--num-layers 8 --block-size 16 --num-kv-heads 4
                                      --head-dim 64 --dtype-bytes 4 --sizes 1,8,64,512]
                                     [--device cuda]   # both buffers in GPU memory (VRAM -> VRAM)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpush.bench.machine import machine_line  # noqa: E402
from kvpush.engine.kv_cache import allocate_kv  # noqa: E402
from kvpush.transfer.descriptors import KVGeometry  # noqa: E402
from kvpush.transfer.kv_agent import XferStatus  # noqa: E402
from kvpush.transfer.nixl_agent import NixlTransferAgent  # noqa: E402

DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}
TIMEOUT_S = 30.0


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def kv_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.num_blocks, args.num_layers, 2, args.block_size, args.num_kv_heads, args.head_dim)


def memory(device: torch.device) -> tuple[str, int]:
    """NIXL memory type and device id of a buffer on ``device``."""
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def target(conn: Any, args: argparse.Namespace) -> None:
    """The receiving instance: stamp each notification ``N:<id>`` and answer ``A:<id>``."""
    torch.set_num_threads(1)
    device = torch.device(args.device)
    kv = allocate_kv(kv_shape(args), DTYPES[args.dtype_bytes], device, args.huge_pages == "on")  # [blocks, layers, 2, bs, h, d]
    agent = NixlTransferAgent("bench-target", *memory(device))
    stamps: dict[str, int] = {}
    try:
        geometry = agent.register_kv(kv)
        conn.send((agent.metadata(), geometry))
        peer_md, peer_geometry = conn.recv()
        peer = agent.add_peer(peer_md, peer_geometry)
        spins = 0
        while True:
            for _, msg in agent.get_notifs():
                stamps[msg.decode()] = now_ns()
                if msg.startswith(b"N:"):
                    agent.send_notif(peer, b"A:" + msg[2:])
            spins += 1
            if args.target_sleep_us:
                time.sleep(args.target_sleep_us / 1e6)
            if spins % 256 == 0 and conn.poll():
                if conn.recv() == "exit":
                    conn.send(stamps)
                    return
    finally:
        agent.close()


@dataclass
class Row:
    blocks: int
    nbytes: int
    descs: int
    memcpy_us: float
    nixl_us: float
    kvpush_us: float
    kvpush_post_us: float


class Initiator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        huge = args.huge_pages == "on"
        self.kv = allocate_kv(kv_shape(args), DTYPES[args.dtype_bytes], self.device, huge)
        self.kv.copy_(torch.randn(kv_shape(args), device=self.device))
        self.scratch = allocate_kv(kv_shape(args), DTYPES[args.dtype_bytes], self.device, huge)
        self.mem_type, self.dev_id = memory(self.device)
        self.agent = NixlTransferAgent("bench-initiator", self.mem_type, self.dev_id)
        self.geometry = self.agent.register_kv(self.kv)
        self.peer = ""
        self.peer_geometry: KVGeometry | None = None
        self.next_id = 0
        self.acked: set[bytes] = set()

    def connect(self, conn: Any) -> None:
        peer_md, self.peer_geometry = conn.recv()
        self.peer = self.agent.add_peer(peer_md, self.peer_geometry)
        conn.send((self.agent.metadata(), self.geometry))

    def _await_ack(self, ident: str, pump: Any) -> None:
        want = f"A:{ident}".encode()
        deadline = time.monotonic() + TIMEOUT_S
        while want not in self.acked:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ack for {ident}")
            self.acked.update(msg for _, msg in pump())

    def _raw_pump(self) -> list[tuple[str, bytes]]:
        new = self.agent._agent.get_new_notifs()
        return [(name, msg) for name, msgs in new.items() for msg in msgs]

    def memcpy_once(self, n: int) -> float:
        t0 = time.perf_counter_ns()
        self.scratch[:n].copy_(self.kv[:n])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter_ns() - t0) / 1e3

    def raw_lists(self, n: int) -> tuple[Any, Any]:
        """One pre-merged descriptor per side for bare nixl (prepared outside the timing)."""
        assert self.peer_geometry is not None
        nbytes = n * self.geometry.block_bytes
        raw = self.agent._agent  # the nixl_agent object the wrapper owns
        local = raw.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.geometry.base_addr, nbytes, self.dev_id)],
                                    self.mem_type)
        remote = raw.prep_xfer_dlist(self.peer, [(self.peer_geometry.base_addr, nbytes, self.peer_geometry.device_id)],
                                     self.peer_geometry.memory_type)
        return local, remote

    def raw_once(self, lists: tuple[Any, Any]) -> tuple[str, int]:
        raw = self.agent._agent
        idx = np.zeros(1, dtype=np.int32)
        ident = f"raw-{self.next_id}"
        self.next_id += 1
        t0 = now_ns()
        handle = raw.make_prepped_xfer("WRITE", lists[0], idx, lists[1], idx, f"N:{ident}".encode())
        state = raw.transfer(handle)
        while state == "PROC":
            state = raw.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"raw transfer ended in {state}")
        handle.release()
        self._await_ack(ident, self._raw_pump)
        return ident, t0

    def wrapper_once(self, blocks: list[int]) -> tuple[str, int, float, int]:
        ident = f"kvp-{self.next_id}"
        self.next_id += 1
        t0 = now_ns()
        t = self.agent.write(self.peer, blocks, blocks, f"N:{ident}".encode())
        if self.agent.wait(t, TIMEOUT_S) is not XferStatus.DONE:
            raise RuntimeError(f"wrapper transfer failed: {t.error}")
        self.agent.release(t)
        self._await_ack(ident, self.agent.get_notifs)
        return ident, t0, t.post_s * 1e6, t.num_descs

    def measure(self, n: int, iters: int) -> tuple[list[float], list[tuple[str, int]], list[tuple[str, int, float, int]]]:
        """The three methods in turn, iteration by iteration, so that drift hits all alike."""
        lists = self.raw_lists(n)
        blocks = list(range(n))
        mem, raw, wrap = [], [], []
        try:
            for i in range(iters + max(2, iters // 10)):
                warm = i < max(2, iters // 10)
                m, r, w = self.memcpy_once(n), self.raw_once(lists), self.wrapper_once(blocks)
                if not warm:
                    mem.append(m)
                    raw.append(r)
                    wrap.append(w)
        finally:
            lists[0].release()
            lists[1].release()
        return mem, raw, wrap


def iterations(nbytes: int, args: argparse.Namespace) -> int:
    return max(args.min_iters, min(args.max_iters, int(args.bytes_per_size / nbytes)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype-bytes", type=int, default=4, choices=sorted(DTYPES))
    parser.add_argument("--sizes", default="1,8,64,512", help="blocks per transfer, comma-separated")
    parser.add_argument("--num-blocks", type=int, default=0, help="buffer size; default: largest size")
    parser.add_argument("--bytes-per-size", type=float, default=1.5e9, help="bytes moved per size and method")
    parser.add_argument("--target-sleep-us", type=float, default=0.0,
                        help="target sleeps this long between notification polls (0: spin)")
    parser.add_argument("--min-iters", type=int, default=10)
    parser.add_argument("--max-iters", type=int, default=300)
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="both KV buffers on transparent huge pages (as kvpush's KVCache) or on 4 KiB pages")
    parser.add_argument("--device", default="cpu", help="cpu (DRAM, the default) or cuda[:N] (VRAM in both processes)")
    args = parser.parse_args()
    if args.device != "cpu":
        from kvpush.engine.device import resolve_device

        args.device = str(resolve_device(args.device))  # a clear error without a GPU
    sizes = [int(s) for s in args.sizes.split(",")]
    args.num_blocks = args.num_blocks or max(sizes)
    torch.set_num_threads(1)

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=target, args=(child_conn, args), daemon=True)
    child.start()
    init = None
    rows: list[Row] = []
    try:
        init = Initiator(args)
        init.connect(conn)
        block_bytes = init.geometry.block_bytes
        print(f"block: {args.num_layers} layers x 2 x {args.block_size} tokens x {args.num_kv_heads} heads "
              f"x {args.head_dim} x {args.dtype_bytes} B = {block_bytes // 1024} KiB; buffer "
              f"{args.num_blocks} blocks ({args.num_blocks * block_bytes / 2**20:.0f} MiB) in "
              f"{init.mem_type} ({args.device})", flush=True)
        pending: list[tuple[int, int, list[float], list[tuple[str, int]], list[tuple[str, int, float, int]]]] = []
        for n in sizes:
            nbytes = n * block_bytes
            iters = iterations(nbytes, args)
            mem, raw, wrap = init.measure(n, iters)
            pending.append((n, nbytes, mem, raw, wrap))
            print(f"  {n} blocks: {iters} iterations each", flush=True)
        conn.send("exit")
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError("target did not report its stamps")
        stamps: dict[str, int] = conn.recv()

        def one_way_us(pairs: list[tuple[str, int]]) -> float:
            return statistics.median((stamps[f"N:{ident}"] - t0) / 1e3 for ident, t0 in pairs)

        for n, nbytes, mem, raw, wrap in pending:
            rows.append(Row(n, nbytes, wrap[-1][3], statistics.median(mem), one_way_us(raw),
                            one_way_us([(w[0], w[1]) for w in wrap]),
                            statistics.median(w[2] for w in wrap)))
    finally:
        if child.is_alive():
            child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)
        if init is not None:
            init.agent.close()

    def gbps(nbytes: int, us: float) -> str:
        return f"{nbytes / us / 1e3:.2f}"

    print()
    print(machine_line())
    print("| blocks | MiB | descs | memcpy us | memcpy GB/s | nixl us | nixl GB/s | nixl - memcpy us "
          "| kvpush us | kvpush GB/s | kvpush - nixl us | kvpush post us |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.blocks} | {r.nbytes / 2**20:g} | {r.descs} | {r.memcpy_us:.1f} | {gbps(r.nbytes, r.memcpy_us)} "
              f"| {r.nixl_us:.1f} | {gbps(r.nbytes, r.nixl_us)} | {r.nixl_us - r.memcpy_us:+.1f} "
              f"| {r.kvpush_us:.1f} | {gbps(r.nbytes, r.kvpush_us)} | {r.kvpush_us - r.nixl_us:+.1f} "
              f"| {r.kvpush_post_us:.1f} |")
    print("\nus: median per transfer; nixl and kvpush: post until the notification reached the target; "
          "kvpush post: time inside make_prepped_xfer + transfer (CMA copies in the caller).")


if __name__ == "__main__":
    main()
