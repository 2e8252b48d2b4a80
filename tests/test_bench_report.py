"""kvpush.bench.report: comparison tables with the right ratios, and valid PNG plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import pytest

from kvpush.bench.cli import add_compare_arguments, run_compare
from kvpush.bench.compare import compare
from kvpush.bench.metrics import RequestRecord, compute_metrics
from kvpush.bench.report import format_table, load_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _records(n: int, ttft: float, tpot: float, out: int = 5, trace: bool = False) -> list[RequestRecord]:
    """n identical successful requests, one per second."""
    recs = []
    for i in range(n):
        rec = RequestRecord(
            index=i, prompt_len=10, output_len=out, scheduled_s=float(i), start_s=float(i), success=True,
            status=200, ttft_s=ttft, itl_s=[tpot] * (out - 1), e2el_s=ttft + tpot * (out - 1),
            output_tokens=out, prompt_tokens=10,
        )
        if trace:
            t0 = 1000.0 + i
            rec.kvpush_trace = {"dispatched": t0, "p_admitted": t0 + 0.001, "p_prefill_done": t0 + ttft / 2,
                                "d_leg_sent": t0, "reg_received": t0 + 0.01, "d_ready": t0 + ttft - 0.002,
                                "first_token": t0 + ttft - 0.001}
            rec.sent_unix, rec.first_chunk_unix = t0, t0 + ttft
        recs.append(rec)
    return recs


def _write(path: Path, mode: str, rate: float | str, ttft: float, tpot: float, duration: float) -> str:
    recs = _records(4, ttft, tpot, trace=mode != "colocated")
    metrics = compute_metrics(recs, duration, float(rate))
    doc = {
        "config": {"mode": mode, "request_rate": rate},
        "metrics": msgspec.to_builtins(metrics),
        "requests": msgspec.to_builtins(recs),
    }
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def run_files(tmp_path: Path) -> list[str]:
    return [
        # rate 1: two push repeats (TTFT 100 and 120 ms -> median 110), one pull (200 ms)
        _write(tmp_path / "push1a.json", "push", 1.0, ttft=0.100, tpot=0.020, duration=4.0),
        _write(tmp_path / "push1b.json", "push", 1.0, ttft=0.120, tpot=0.020, duration=4.0),
        _write(tmp_path / "pull1.json", "pull", 1.0, ttft=0.200, tpot=0.025, duration=8.0),
        _write(tmp_path / "colo1.json", "colocated", 1.0, ttft=0.050, tpot=0.040, duration=4.0),
        # rate inf: push only
        _write(tmp_path / "pushinf.json", "push", "inf", ttft=0.300, tpot=0.030, duration=2.0),
    ]


def _section(table: str, rate: str) -> list[str]:
    part = table.split(f"### request rate {rate} req/s")[1].split("###")[0]
    return [line for line in part.splitlines() if line.startswith("|")]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_format_table_ratios(run_files):
    table = format_table([load_run(f) for f in run_files])
    rows = _section(table, "1")
    assert _cells(rows[0])[:4] == ["mode", "runs", "ok/failed", "TTFT p50 (ms)"]
    modes = [_cells(r)[0] for r in rows[2:]]
    assert modes == ["push", "pull", "colocated", "**push/pull**"]
    push, pull, ratio = _cells(rows[2]), _cells(rows[3]), _cells(rows[5])
    assert push[1:3] == ["2", "8/0"]
    # TTFT p50, p99: push 110 (median of repeats), pull 200 -> 0.55
    assert push[3:5] == ["110.00", "110.00"] and pull[3:5] == ["200.00", "200.00"]
    # TTFT and TPOT ratios carry the bootstrap interval over pooled requests and a verdict
    assert ratio[3] == "0.550 [0.500, 0.600] push better"  # p50 of pooled push (100, 120 ms) / 200 ms
    assert ratio[4].startswith("0.600 [") and ratio[4].endswith("push better")  # p99: 120 / 200 ms
    # TPOT 20 vs 25 ms -> 0.8; throughput 1.0 vs 0.5 req/s -> 2.0; 5.0 vs 2.5 tok/s -> 2.0
    assert ratio[5:7] == ["0.800 [0.800, 0.800] push better"] * 2
    assert ratio[7:9] == ["2.000", "2.000"]
    inf_rows = _section(table, "inf")
    assert [_cells(r)[0] for r in inf_rows[2:]] == ["push"]  # no pull at inf: no ratio row


def test_compare_writes_markdown_and_pngs(run_files, tmp_path: Path):
    md_path, pngs = compare(run_files, tmp_path / "out")
    text = md_path.read_text()
    assert "| **push/pull** |" in text and "0.550" in text
    assert "## Handover breakdown" in text and "dispatched->p_admitted" in text
    assert "## Critical path" in text
    phases = next(line for line in text.splitlines() if line.startswith("| 1 | pull |"))
    # to prefill 1, prefill 99, handover 98, to client 2 ms; sum = TTFT 200; registration 10 ms
    assert _cells(phases)[2:] == ["1.00", "99.00", "98.00", "2.00", "200.00", "10.00"]
    assert [p.name for p in pngs] == ["ttft_vs_rate.png", "tpot_vs_rate.png", "critical_path.png"]
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 10_000
        assert f"]({png.name})" in text


def test_compare_without_traces_has_no_handover_plot(tmp_path: Path):
    files = [_write(tmp_path / "c.json", "colocated", 2.0, ttft=0.05, tpot=0.01, duration=2.0)]
    _, pngs = compare(files, tmp_path / "out")
    assert [p.name for p in pngs] == ["ttft_vs_rate.png", "tpot_vs_rate.png"]


def test_load_run_rejects_other_json(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a kvpush bench run"):
        load_run(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_run(tmp_path / "missing.json")


def test_run_compare_cli(run_files, tmp_path: Path, capsys):
    parser = argparse.ArgumentParser(prog="kvpush bench compare")
    add_compare_arguments(parser)
    args = parser.parse_args([*run_files, "--out", str(tmp_path / "cli")])
    assert run_compare(args) == 0
    out = capsys.readouterr().out
    assert "**push/pull**" in out and "comparison.md" in out
    args = parser.parse_args([str(tmp_path / "missing.json"), "--out", str(tmp_path / "cli2")])
    assert run_compare(args) == 1
    assert "error: cannot read run file" in capsys.readouterr().err


def test_ratio_verdicts_follow_the_interval(tmp_path: Path):
    import numpy as np

    rng = np.random.default_rng(0)

    def run(mode: str, ttfts) -> dict:
        recs = [RequestRecord(index=i, prompt_len=1, output_len=1, success=True, ttft_s=float(t), e2el_s=float(t),
                              output_tokens=1) for i, t in enumerate(ttfts)]
        return {"config": {"mode": mode, "request_rate": 1.0},
                "metrics": msgspec.to_builtins(compute_metrics(recs, 10.0, 1.0)), "requests": msgspec.to_builtins(recs)}

    same = format_table([run("push", rng.normal(0.2, 0.02, 200)), run("pull", rng.normal(0.2, 0.02, 200))])
    assert "cannot tell" in _cells(_section(same, "1")[-1])[3]
    worse = format_table([run("push", rng.normal(0.25, 0.02, 200)), run("pull", rng.normal(0.2, 0.02, 200))])
    assert "pull better" in _cells(_section(worse, "1")[-1])[3]


def _seeded_run(mode: str, seed: int, ttfts, failed: tuple[int, ...] = ()) -> dict:
    recs = [RequestRecord(index=i, prompt_len=1, output_len=1, success=i not in failed,
                          ttft_s=None if i in failed else float(t), e2el_s=float(t), output_tokens=1)
            for i, t in enumerate(ttfts)]
    return {"config": {"mode": mode, "request_rate": 1.0}, "run": {"sample_seed": seed},
            "metrics": msgspec.to_builtins(compute_metrics(recs, 10.0, 1.0)), "requests": msgspec.to_builtins(recs)}


def test_paired_groups_match_prompt_sets_and_requests():
    from kvpush.bench.report import paired_groups

    push = [_seeded_run("push", 1, [1.0, 2.0, 3.0], failed=(1,)), _seeded_run("push", 2, [4.0, 5.0])]
    pull = [_seeded_run("pull", 2, [6.0, 7.0]), _seeded_run("pull", 1, [8.0, 9.0, 10.0], failed=(2,))]
    # matched by seed, then by index; a request that failed on either side drops out of its pair
    assert paired_groups(push, pull, "ttft") == [([1000.0], [8000.0]), ([4000.0, 5000.0], [6000.0, 7000.0])]
    assert paired_groups(push, [pull[0], _seeded_run("pull", 3, [1.0])], "ttft") is None  # other prompts
    assert paired_groups(push[:1], pull[1:], "ttft") == [([1000.0], [8000.0])]  # one shared prompt set
    twice = [_seeded_run("push", 1, [1.0]), _seeded_run("push", 1, [1.0])]
    assert paired_groups(twice, pull, "ttft") is None


def test_paired_interval_uses_the_shared_prompts():
    """Same prompts, push 3% faster on every request, prompts spread 10x wider than that: the paired
    interval sees the 3% (push better); a pooled one would not (the unpaired interval spans 1)."""
    import numpy as np

    from kvpush.bench.report import mode_ratio_ci
    from kvpush.bench.stats import p99, ratio_ci

    rng = np.random.default_rng(1)
    base = [rng.lognormal(np.log(0.2), 0.5, 50) for _ in range(4)]
    noise = [rng.normal(1.0, 0.002, 50) for _ in range(4)]
    push = [_seeded_run("push", s, b * 0.97 * n) for s, (b, n) in enumerate(zip(base, noise, strict=True))]
    pull = [_seeded_run("pull", s, b) for s, b in enumerate(base)]
    est, lo, hi = mode_ratio_ci(push, pull, "ttft", p99)
    assert hi < 1.0 and abs(est - 0.97) < 0.01
    pooled = [float(t) for b in base for t in b]
    _, ulo, uhi = ratio_ci([t * 0.97 for t in pooled], pooled, stat=p99)
    assert ulo < 1.0 < uhi


def test_paired_interval_carries_drift_between_repeats():
    """Each repeat agrees with itself, but one repeat disagrees with the other three (push 20% better in
    three, 25% worse in one, as a machine drifting between runs could make it): the requests pooled and
    paired say "push better", the repeats resampled too cannot tell."""
    import numpy as np

    from kvpush.bench.report import mode_ratio_ci
    from kvpush.bench.stats import p50, ratio_ci

    rng = np.random.default_rng(2)
    base = [rng.normal(0.2, 0.01, 50) for _ in range(4)]
    factors = (0.8, 0.8, 0.8, 1.25)
    push = [_seeded_run("push", s, b * f) for s, (b, f) in enumerate(zip(base, factors, strict=True))]
    pull = [_seeded_run("pull", s, b) for s, b in enumerate(base)]
    _, lo, hi = mode_ratio_ci(push, pull, "ttft", p50)
    assert lo < 1.0 < hi
    pooled_push = np.concatenate([b * f for b, f in zip(base, factors, strict=True)])
    _, plo, phi = ratio_ci(pooled_push, np.concatenate(base), stat=p50, paired=True)
    assert phi < 1.0  # what ignoring the repeats would have concluded


def test_pairing_needs_the_same_workload_and_seeds_on_both_sides():
    from kvpush.bench.report import mode_ratio_ci, paired_groups
    from kvpush.bench.stats import p50

    push = [_seeded_run("push", 1, [1.0, 2.0]), _seeded_run("push", 2, [3.0, 4.0])]
    pull = [_seeded_run("pull", 1, [1.0, 2.0]), _seeded_run("pull", 2, [3.0, 4.0])]
    pull[1]["config"]["input_len"] = 1024  # same seed, other prompts
    assert paired_groups(push, pull, "ttft") is None
    unseeded = [dict(r, run={}) for r in pull]
    assert paired_groups(push, unseeded, "ttft") is None and mode_ratio_ci(push, unseeded, "ttft", p50) is not None
    one = mode_ratio_ci(push[:1], [_seeded_run("pull", 1, [2.0, 4.0])], "ttft", p50)  # one shared set: paired
    assert one is not None and one[1:] == (0.5, 0.5)
