"""`kvpush bench` against a real server: a colocated kvpush whose served model name differs from its
path (as any other OpenAI-compatible server would be driven), then `kvpush bench compare`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.bench.machine import cpu_label
from kvpush.cli import main

pytestmark = pytest.mark.integration
SERVER_ARGS = ["--num-blocks", "256", "--block-size", "8"]


def bench(url: str, out: Path, label: str, rate: str) -> Path:
    code = main(["bench", "--base-url", url, "--result-dir", str(out), "--input-len", "24", "--output-len", "6",
                 "--num-prompts", "8", "--num-warmups", "1", "--request-rate", rate, "--ignore-eos",
                 "--mode-label", label, "--no-progress", "--vocab-size", "1000", "--avoid-token-ids", "0,1,2"])
    assert code == 0
    [path] = [p for p in out.glob(f"{label}-*.json")]
    return path


def test_bench_real_server_and_compare(module_server, tmp_path):
    runs = [bench(module_server.url, tmp_path, label, rate) for label, rate in (("push", "4"), ("pull", "4"))]
    doc = json.loads(runs[0].read_text())
    assert doc["config"]["model"] == "tiny"  # found via /v1/models: the served name, not the path
    m = doc["metrics"]
    assert m["completed"] == 8 and m["failed"] == 0
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "median_e2el_ms",
                "request_throughput", "output_throughput", "saturated"):
        assert m[key] is not None, key
    assert m["total_output_tokens"] == 8 * 6
    assert doc["environment"]["torch"] and doc["environment"]["cpu_count"]
    assert len(doc["requests"]) == 8 and all(r["success"] for r in doc["requests"])
    out = tmp_path / "compare"
    assert main(["bench", "compare", *map(str, runs), "--out", str(out)]) == 0
    table = (out / "comparison.md").read_text()
    assert "push/pull" in table
    assert f"Machine: {cpu_label(doc['environment']['machine'])}." in table  # the table names its CPU
    for png in ("ttft_vs_rate.png", "tpot_vs_rate.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
