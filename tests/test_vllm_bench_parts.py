"""The plain parts of benchmarks/vllm_connector.py: vLLM bench result parsing, the fragmenting order,
the push proxy's legs (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvpush.bench.suite import SuiteConfig
from kvpush.bench.vllm_client import VllmBench, load_vllm_run

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_run_parsed_per_request_and_failures_left_out(tmp_path):
    doc = {"completed": 2, "failed": 1, "ttfts": [0.1, 0.2, 0.0], "latencies": [0.4, 0.5, 0.0],
           "output_lens": [4, 1, 0], "itls": [[0.1, 0.1, 0.1], [], []], "errors": ["", "", "boom"],
           "median_ttft_ms": 150.0}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    run = load_vllm_run(path)
    assert run.ok == [True, True, False] and run.errors == ["boom"]
    assert run.values["ttft"] == pytest.approx([100.0, 200.0])
    assert run.values["tpot"] == pytest.approx([100.0])  # (0.4 - 0.1) / 3; one-token outputs have none
    assert run.as_dict()["summary"] == {"median_ttft_ms": 150.0}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="missing"):
        load_vllm_run(tmp_path / "bad.json")


def test_one_at_a_time_is_max_concurrency_one(tmp_path):
    cfg = SuiteConfig(model="m", result_dir=str(tmp_path))
    argv = VllmBench(".vllm-peer", "http://x", "bench", "m", cfg, float("inf"), 1, "n", max_concurrency=1).argv
    assert argv[argv.index("--max-concurrency") + 1] == "1" and argv[argv.index("--request-rate") + 1] == "inf"
    assert "--max-concurrency" not in VllmBench(".vllm-peer", "http://x", "bench", "m", cfg, 1.0, 1, "n").argv


@pytest.mark.parametrize("n", [2, 7, 14, 29, 1000])
def test_fragmenting_order_visits_every_block_never_two_neighbours_in_a_row(n):
    order = load(BENCH / "vllm_fragment" / "sitecustomize.py", "kvpush_fragment").stride_order(n)
    assert sorted(order) == list(range(n))
    if n > 8:
        assert all(abs(a - b) > 1 for a, b in zip(order, order[1:], strict=False))


def test_push_proxy_legs_follow_vllm_push_protocol():
    proxy = load(BENCH / "vllm_push_proxy.py", "kvpush_push_proxy")
    body = proxy.prefill_body({"prompt": "x", "max_tokens": 9, "stream": True, "stream_options": {}, "min_tokens": 3})
    assert body == {"prompt": "x", "max_tokens": 1, "stream": False,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    answer = {"kv_transfer_params": {"remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
                                     "remote_port": 5, "tp_size": 1, "remote_block_ids": [1, 2]}}
    leg = proxy.decode_params(answer)
    assert leg["do_remote_prefill"] and leg["remote_engine_id"] == "e" and "remote_block_ids" not in leg


def test_table_ratio_pairs_by_repeat_and_counts_cut_runs():
    bench = load(BENCH / "vllm_connector.py", "kvpush_vllm_connector_bench")

    def run(front, rep, ttft, cut=False):
        values = {"ttft": ttft, "tpot": [10.0] * len(ttft), "itl": []}
        return {"group": "kvpush", "front": front, "rate": 1.0, "rep": rep,
                "run": None if cut else {"completed": len(ttft), "failed": 0, "values": values}}

    base = [100.0, 110.0, 120.0, 130.0]
    runs = [run("colocated", 0, base), run("kvpush-push", 0, [2 * v for v in base]),
            run("colocated", 1, base), run("kvpush-push", 1, [], cut=True)]
    text = bench.table({"runs": runs, "errors": [], "idle_cpu": {}, "posted": {}})
    push = next(line for line in text.splitlines() if "kvpush-push" in line)
    cells = [c.strip() for c in push.split("|")]
    assert cells[4] == "4/0/1"  # the cut repeat is counted, not dropped silently
    assert cells[8].startswith("2.00 [2.00, 2.00]") and cells[9].startswith("1.00")
