"""The plain parts of benchmarks/vllm_connector.py: vLLM bench result parsing, the fragmenting order,
the push proxy's legs (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

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


def test_the_client_can_be_pinned(tmp_path):
    cfg = SuiteConfig(model="m", num_prompts=2, input_len=8, output_len=2, result_dir=str(tmp_path))
    argv = VllmBench(".vllm-peer", "http://x", "bench", "m", cfg, 1.0, 1, "n", prefix=["taskset", "-c", "1"]).argv
    assert argv[:3] == ["taskset", "-c", "1"] and argv[3].endswith("vllm")


def test_emulate_vs_real_pairs_prompts_and_judges_the_10_percent():
    """benchmarks/emulate_vs_real.py's plain parts: per-request values from a kvpush bench JSON, the table."""
    evr = load(BENCH / "emulate_vs_real.py", "emulate_vs_real")
    doc = {"config": {"num_prompts": 3}, "requests": [
        {"index": 0, "success": True, "ttft_s": 0.1, "e2el_s": 0.5, "output_tokens": 5},
        {"index": 2, "success": True, "ttft_s": 0.2, "e2el_s": 0.2, "output_tokens": 1},
        {"index": 1, "success": False, "ttft_s": None, "e2el_s": None, "output_tokens": 0}]}
    values = evr.per_request(doc)
    assert values["ttft"][0] == pytest.approx(100.0) and values["tpot"][0] == pytest.approx(100.0)
    assert all(v != v for v in (values["ttft"][1], values["tpot"][1], values["tpot"][2]))  # NaN: failed, one token
    real = {"ttft": [100.0 + i for i in range(20)], "tpot": [10.0] * 20}
    runs = [{"deployment": "colocated", "kind": kind, "rate": "0", "rep": rep, "emulation": emulation,
             "values": {"ttft": [x * scale for x in real["ttft"]], "tpot": [x * scale for x in real["tpot"]]}}
            for rep in (0, 1) for kind, scale, emulation in (("real", 1.0, None), ("emulated", 1.02, {"valid": True}))]
    text = evr.table({"machine": "m", "args": {"deployments": ["colocated"], "rates": [0.0]}, "runs": runs})
    assert "| colocated | one at a time | TTFT p50 |" in text and "1.02 [1.02, 1.02] within 10%" in text
    assert "valid (lateness p99 within 5% of the median step): 2 of 2" in text
    args = SimpleNamespace(rates=[0.0, 2.0], loads=[0.5, 0.8])
    assert evr.rates_of(args, {"push": 3.0}, "push") == [("0", 0.0), ("2", 2.0), ("50%", 1.5), ("80%", 2.4)]
    loaded = [{**r, "rate": "80%"} for r in runs]
    assert "| colocated | 80% of capacity | TPOT p50 |" in evr.table({"machine": "m", "args": {"deployments": ["colocated"]},
                                                                      "runs": loaded})


def test_emulate_scale_counts_transfers_routes_and_what_an_idle_deployment_still_holds():
    """benchmarks/emulate_scale.py's plain parts: sums over /metrics samples, one run's row (deltas of the
    counters, what is held once idle), and its table line."""
    from prometheus_client.parser import text_string_to_metric_families

    scale = load(BENCH / "emulate_scale.py", "emulate_scale")
    fams = list(text_string_to_metric_families(
        'kvpush_kv_transfer_failures_total{reason="expired"} 2\nkvpush_kv_transfer_failures_total{reason="peer"} 1\n'
        'kvpush_kv_transfers{state="DONE"} 0\nkvpush_kv_transfers{state="POSTED"} 3\n'))
    assert scale.total(fams, "kvpush_kv_transfer_failures_total") == 3
    assert scale.by_label(fams, "kvpush_kv_transfers", "state") == {"DONE": 0, "POSTED": 3}
    base = {"requests": 10, "shed": 0, "rerouted": 0, "completed": 5, "ignored": 0, "fallbacks": 0,
            "routes": {"push": 4}, "failure_reasons": {"expired": 1}, "records_by_state": {"done": 200}}
    after = {**base, "requests": 130, "completed": 125, "routes": {"push": 100, "pull": 24}, "instances": 16,
             "failure_reasons": {"expired": 1}}
    idle = {"records_by_state": {"posted": 0, "done": 240}, "quarantined": 0, "blocks_used": 0}
    doc = {"metrics": {"completed": 120, "failed": 0, "request_throughput": 3.9},
           "emulation": {"valid": True, "emulated_time_ms": {"median_ttft_ms": 31.0, "median_tpot_ms": 4.5}}}
    r = scale.row(4.0, doc, base, after, idle, 40.0)
    # every request moved KV: transfers per second of the measured window = its request throughput
    assert r["transfers"] == 120 and r["transfers_per_s"] == pytest.approx(3.9) and r["routes"] == {"push": 96, "pull": 24}
    assert r["tombstones_added"] == 40
    assert r["failures"] == {} and r["proxy_requests"] == 120 and r["valid"] is True
    text = scale.table({"machine": "m", "command": ["up", "m"], "rows": [r],
                        "args": {"profile": "qwen3-32b-h200-tp8", "time_scale": 40.0}})
    assert "EMULATED: qwen3-32b-h200-tp8, x40" in text
    assert "| 4 | 120/0 | 3.90 | 3.90 | push 96, pull 24 | 0 / 0 | 0 | 0 | 0 (+40) | 0 / 0 | 31.0 / 4.50 | True |" in text
