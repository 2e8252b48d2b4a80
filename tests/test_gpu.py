"""KV on a device: NIXL with the buffer in GPU memory (VRAM) across two processes, and 1P1D
deployments with P and D on the same GPU, byte for byte against a colocated instance there.

Every test runs for `device` in [cpu, cuda]: cuda skips with "no CUDA device" where torch sees no GPU;
the cpu cases repeat test_nixl_agent / test_disagg coverage, so they run only under `--cpu-twins`
(scripts/gpu_check.sh --dry-run uses them to check these tests without a GPU).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import msgspec
import pytest
import torch
from kvpush_testing import BS, SERVE, Cluster, completion, devices, metric, prompt_of

from kvpush.launcher.launch import ServerProcess, free_port

pytestmark = pytest.mark.integration

DEVICES = devices(cpu_twin=True)
SHAPE = (24, 4, 2, 8, 2, 16)  # kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
TIMEOUT_S = 30.0


def _kv(device: str, seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(SHAPE, dtype=torch.bfloat16, device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen).to(torch.bfloat16).to(device)


def _agent(name: str, kv: torch.Tensor):
    from kvpush.transfer.nixl_agent import NixlTransferAgent

    memory_type = "VRAM" if kv.is_cuda else "DRAM"
    return NixlTransferAgent(name, memory_type, kv.device.index or 0)


def _peer_process(conn, device: str) -> None:  # runs in a spawned process: "D", a zeroed buffer
    from kvpush.transfer.nixl_agent import KVGeometry

    kv = _kv(device, None)
    agent = _agent("gpu-d", kv)
    try:
        geometry = agent.register_kv(kv)
        conn.send((agent.metadata(), msgspec.msgpack.encode(geometry)))
        peer_md, peer_geometry = conn.recv()
        agent.add_peer(peer_md, msgspec.msgpack.decode(peer_geometry, type=KVGeometry))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # progress notifications; answer "dump" with the buffer
            for _, msg in agent.get_notifs():
                if msg.startswith(b"W:"):
                    conn.send(("landed", msg.decode()))
            if conn.poll(0.0005):
                cmd = conn.recv()
                if cmd == "dump":
                    conn.send(kv.cpu())
                elif cmd == "exit":
                    break
    finally:
        agent.close()


def _recv(conn, what: str):
    if not conn.poll(TIMEOUT_S * 2):
        raise AssertionError(f"the peer process sent no {what} in time")
    return conn.recv()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", DEVICES)
def test_two_processes_write_layers_and_read(device) -> None:
    """P (this process) WRITEs whole blocks and single layers into D's buffer and READs some back:
    every byte lands where it should, nothing else changes, on DRAM or VRAM alike."""
    pytest.importorskip("nixl", reason="nixl is not installed (make install)")
    from kvpush.transfer.nixl_agent import KVGeometry, TransferState

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_peer_process, args=(child_conn, device), daemon=True)
    kv = _kv(device, seed=5)  # [N, L, 2, bs, kvh, hd]
    agent = _agent("gpu-p", kv)
    child.start()
    try:
        geometry = agent.register_kv(kv)
        assert geometry.memory_type == ("VRAM" if device == "cuda" else "DRAM")
        peer_md, peer_geometry = _recv(conn, "metadata")
        peer = agent.add_peer(peer_md, msgspec.msgpack.decode(peer_geometry, type=KVGeometry))
        conn.send((agent.metadata(), msgspec.msgpack.encode(geometry)))

        t = agent.write(peer, [0, 1, 2, 7], [10, 11, 12, 3], b"W:blocks")  # 2 runs
        assert agent.wait(t, TIMEOUT_S) is TransferState.DONE and t.num_descs == 2
        agent.release(t)
        assert _recv(conn, "notification") == ("landed", "W:blocks")
        t = agent.write_layers(peer, [4, 5], [20, 21], [1, 3], b"W:layers")
        assert agent.wait(t, TIMEOUT_S) is TransferState.DONE
        agent.release(t)
        assert _recv(conn, "notification") == ("landed", "W:layers")
        conn.send("dump")
        theirs = _recv(conn, "buffer")  # [N, L, 2, bs, kvh, hd] on the CPU
        mine = kv.cpu()
        expected = torch.zeros_like(mine)
        expected[[10, 11, 12, 3]] = mine[[0, 1, 2, 7]]
        expected[20:22, [1, 3]] = mine[4:6, [1, 3]]
        assert torch.equal(theirs, expected)  # bit for bit, and the rest is still zero

        t = agent.read(peer, [22, 23], [10, 20])  # and back: D's copies of P's blocks 0 and (4, layers 1, 3)
        assert agent.wait(t, TIMEOUT_S) is TransferState.DONE
        agent.release(t)
        now = kv.cpu()
        assert torch.equal(now[22], mine[0]) and torch.equal(now[23], expected[20])
        assert torch.equal(now[:22], mine[:22])
    finally:
        if child.is_alive():
            conn.send("exit")
            child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join(TIMEOUT_S)
        agent.close()


PROMPTS = {"one-block": BS, "partial-last-block": 3 * BS + 5, "many-chunks": 9 * BS + 1}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
def test_disaggregated_equals_colocated_on_device(tiny_model, tmp_path, device) -> None:
    """P and D (two processes, the same device) in pull, push and push-layerwise modes give the colocated
    instance's greedy tokens and text on that device, for prompts of one block, a partial last block and
    several prefill chunks (P prefills 16 tokens a step, so layer-wise push writes per chunk and layer)."""
    on = ("--device", device)
    port = free_port()
    colocated = ServerProcess(["serve", tiny_model, "--port", str(port), *SERVE, *on],
                              log_path=str(tmp_path / "colocated.log")).start()
    try:
        colocated.wait_healthy(180)
        prompts = {name: prompt_of(n, seed=len(name)) for name, n in PROMPTS.items()}
        expected = {name: completion(colocated.url, p)[:2] for name, p in prompts.items()}
    finally:
        colocated.stop()
    for mode in ("pull", "push", "push-layerwise"):
        c = Cluster(tiny_model, mode, tmp_path, extra_decode=on, extra_prefill=(*on, "--max-num-batched-tokens", "16"))
        try:
            proxy = c.wait().proxy("from-prefill")
            for name, p in prompts.items():
                assert completion(proxy.url, p)[:2] == expected[name], (mode, name)
            assert metric(c.decodes[0].url, "kvpush_kv_transfer_bytes_total") > 0
        finally:
            c.stop()
