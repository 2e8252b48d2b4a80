"""When does a NIXL notification reach its peer, if the sender stops calling into NIXL after sending it?

With nixl's progress thread off (kvpush's setting), UCX moves data only inside agent calls. The transfer
thread therefore polls tightly for GRACE_S after every notification it sends (thread.py's Pacer), in
case the message still waits on the sender's side. This measures when that happens: two processes,
each with a real agent (kvpush's UCX settings, or --ucx-tls); the sender sends a notification of SIZE
bytes (or, with --bound, posts a 2-block WRITE carrying it and polls the WRITE to DONE), then makes K
more progress calls (`get_notifs`) and none for the next --quiet-ms, while the receiver polls as fast as
it can for that message. First, the first message after the handshake, with --first-progress calls.

    python benchmarks/notif_delivery.py [--sizes 64 1024 8192 65536] [--progress 0 1 2] [--trials 100]
                                        [--quiet-ms 20] [--ucx-tls tcp,self] [--bound] [--first-progress K]

Prints whether the first message arrived, then per size and K: delivered within the quiet time, and
the latency from the send (or the WRITE's post) to arrival, p50 / p99 / max. Seen with nixl 1.5 here:
the first message never arrives without the sender's later calls (not even after 16 back-to-back
ones); later standalone ones (64 B to 256 KiB, tcp and sm) arrive with none; over tcp a WRITE's own
notification takes 5-8 ms and sometimes does not arrive at all while the sender is quiet.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import msgspec
import torch

from kvpush.transfer.descriptors import KVGeometry
from kvpush.transfer.kv_agent import XferStatus
from kvpush.transfer.nixl_agent import NixlTransferAgent

SHAPE = (16, 2, 2, 4, 2, 8)  # a small KV buffer: the agents need one registered to peer


def _agent(name: str, conn) -> tuple[NixlTransferAgent, str]:
    agent = NixlTransferAgent(name)
    geometry = agent.register_kv(torch.zeros(SHAPE))
    conn.send((agent.metadata(), msgspec.msgpack.encode(geometry)))
    md, geo = conn.recv()
    return agent, agent.add_peer(md, msgspec.msgpack.decode(geo, type=KVGeometry))


def receiver(conn) -> None:
    agent, _ = _agent("notif-receiver", conn)
    try:
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            expected, wait_s = cmd
            deadline = time.monotonic() + wait_s
            arrived = None
            while arrived is None and time.monotonic() < deadline:
                if any(msg == expected for _, msg in agent.get_notifs()):
                    arrived = time.monotonic()
            conn.send(arrived)
    finally:
        agent.close()


def trial(agent: NixlTransferAgent, peer: str, conn, size: int, progress: int, quiet_s: float,
          bound: bool = False) -> float | None:
    """Seconds from send to arrival, or None if nothing arrived within quiet_s."""
    msg = os.urandom(size)  # unique: a late copy of an earlier trial's message is not this one
    conn.send((msg, quiet_s + 0.05))  # the receiver starts polling for it
    time.sleep(0.005)
    sent = time.monotonic()
    if bound:  # the notification of a WRITE: poll the WRITE to its end, then `progress` more calls
        transfer = agent.write(peer, [0, 1], [2, 3], msg)
        while agent.poll(transfer) is XferStatus.POSTED:
            pass
        agent.release(transfer)
    else:
        agent.send_notif(peer, msg)
    for _ in range(progress):
        agent.get_notifs()
    time.sleep(quiet_s)
    arrived = conn.recv()
    if arrived is None or arrived - sent > quiet_s:
        agent.get_notifs()  # let it out before the next trial
        return None
    return arrived - sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 8192, 65536])
    ap.add_argument("--progress", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--quiet-ms", type=float, default=20.0)
    ap.add_argument("--bound", action="store_true",
                    help="the notification of a WRITE (2 blocks), sent once the WRITE polled DONE")
    ap.add_argument("--first-progress", type=int, default=0, help="progress calls after the first message")
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for both agents (default: kvpush's, tcp,sm,cma,self)")
    args = ap.parse_args()
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # set values win over kvpush's defaults; the child inherits it
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child,), daemon=True)
    proc.start()
    agent, peer = _agent("notif-sender", parent)
    try:
        first = trial(agent, peer, parent, 64, args.first_progress, args.quiet_ms / 1e3)  # the peer's first message
        print(f"first message after the handshake, {args.first_progress} progress calls: "
              f"{'not delivered' if first is None else f'delivered in {first * 1e6:.0f} us'}")
        for _ in range(5):  # wire-up: the next messages run with the endpoints open
            trial(agent, peer, parent, 64, 4, 0.02)
        print("| size B | progress calls after send | delivered within quiet time | latency p50 / p99 / max us |")
        print("|---|---|---|---|")
        for size in args.sizes:
            for k in args.progress:
                got = [trial(agent, peer, parent, size, k, args.quiet_ms / 1e3, args.bound) for _ in range(args.trials)]
                lat = sorted(x * 1e6 for x in got if x is not None)
                share = f"{len(lat)}/{len(got)}"
                cell = (f"{statistics.median(lat):.0f} / {lat[int(0.99 * (len(lat) - 1))]:.0f} / {lat[-1]:.0f}"
                        if lat else "-")
                print(f"| {size} | {k} | {share} | {cell} |", flush=True)
    finally:
        parent.send(None)
        proc.join(10)
        agent.close()


if __name__ == "__main__":
    main()
