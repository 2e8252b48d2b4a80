"""The regime map's arithmetic and report on synthetic runs: per-mode percentiles, push/pull and
auto/best-fixed ratios with verdicts, the findings text naming its cells, the heatmap and the README
section replaced in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.bench.regime import Cell, MapConfig, num_prompts, summarize
from kvpush.bench.regime_report import findings, markdown, markers, report, section_name


def run(ttfts_ms: list[float], tpot_ms: float = 10.0, out: int = 9, seed: int = 0) -> dict:
    """One run's document; runs of different modes with the same seed ran the same prompts (paired)."""
    reqs = [{"success": True, "ttft_s": t / 1e3, "e2el_s": t / 1e3 + tpot_ms / 1e3 * (out - 1), "output_tokens": out}
            for t in ttfts_ms]
    return {"metrics": {"completed": len(reqs), "failed": 0}, "requests": reqs, "run": {"sample_seed": seed},
            "config": {}}


def spread(center: float, n: int = 30) -> list[float]:
    return [center * (0.9 + 0.2 * i / (n - 1)) for i in range(n)]


def runs_of(center: float, k: int = 3) -> list[dict]:
    """30 requests around `center` as k runs (a verdict on TTFT p99 or TPOT needs 3 runs a side)."""
    values = spread(center)
    return [run(values[i::k], seed=i) for i in range(k)]


def cell_summary(push: float, pull: float, auto: float, layerwise: float = 500.0, prefix: str = "none") -> dict:
    runs = {"colocated": runs_of(90), "pull": runs_of(pull), "push": runs_of(push),
            "push-layerwise": runs_of(layerwise), "auto": runs_of(auto)}
    return summarize(Cell("full", 512, 32, 0.5, prefix), 1.2, runs, {"push": 20, "local": 10})


def test_summary_percentiles_and_ratios():
    s = cell_summary(push=100, pull=150, auto=100)
    assert s["modes"]["pull"]["ttft_p50_ms"] == pytest.approx(150)
    assert s["modes"]["push"]["runs"] == 3 and s["modes"]["push"]["completed"] == 30  # three runs pooled
    assert s["modes"]["push"]["tpot_p50_ms"] == pytest.approx(10)
    r = s["push_vs_pull"]["ttft_p50"]
    assert r["ratio"] == pytest.approx(100 / 150) and r["verdict"] == "push better" and r["hi"] < 1
    assert s["push_vs_pull"]["tpot_p50"]["verdict"] == "cannot tell"  # identical TPOT
    assert s["auto_vs_best"]["best"] == "push" and s["auto_vs_best"]["ttft_p50"]["verdict"] == "cannot tell"
    worse = cell_summary(push=100, pull=150, auto=160)
    assert worse["auto_vs_best"]["ttft_p50"]["verdict"] == "push better"


def test_findings_name_the_cells_and_never_count_cannot_tell():
    doc = {"config": MapConfig(model="m").__dict__,
           "cells": [cell_summary(100, 150, 100), cell_summary(200, 150, 230, prefix="sessions"),
                     cell_summary(100, 100, 100)]}
    text = findings(doc)
    assert "push better in 1 cell(s): full 512/32 50% none" in text
    assert "pull better in 1: full 512/32 50% sessions" in text and "cannot tell in 1." in text
    assert "worse beyond the interval in 1 of 3 cell(s): full 512/32 50% sessions" in text
    table = markdown(doc)
    assert table.count("\n") == 2 + 3 - 1 and "**push better**" in table and "push 20, local 10" in table


def test_report_writes_png_and_replaces_the_readme_section(tmp_path: Path):
    doc = {"config": {**MapConfig(model="m", command="python benchmarks/regime_map.py --quick").__dict__},
           "elapsed_s": 600, "cells": [cell_summary(100, 150, 100), cell_summary(200, 150, 230, prefix="sessions")]}
    path = tmp_path / "regime_map.json"
    path.write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    begin, end = markers("quick")
    readme.write_text(f"# x\n\nbefore\n\n{begin}\nold text\n{end}\n\nafter\n")
    text = report(path, readme, Path("docs/img/regime_map.png"))
    body = readme.read_text()
    assert "old text" not in body and body.startswith("# x\n\nbefore\n\n") and body.endswith("\n\nafter\n")
    assert text in body and "python benchmarks/regime_map.py --quick" in text
    assert (tmp_path / "docs/img/regime_map_quick.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "regime_map.md").read_text().strip() == text


def test_prompts_per_run_follow_the_rate_within_bounds():
    cfg = MapConfig(model="m", run_s=20, min_prompts=12, max_prompts=40)
    assert [num_prompts(cfg, r) for r in (0.1, 1.0, 5.0)] == [12, 20, 40]


def test_auto_proxy_args_reach_only_the_auto_deployments_proxy(tmp_path: Path):
    """`--auto-proxy-args` (e.g. a stall weight to compare) goes to the auto deployment's proxy only
    (nothing is started here: the fleet's processes are only described)."""
    from kvpush.bench.suite import Fleet, SuiteConfig

    cfg = SuiteConfig(model="m", modes=("push", "auto"), auto_proxy_args=["--auto-stall-weight", "2"])
    fleet = Fleet(cfg, str(tmp_path))
    assert fleet.deployments["auto"].proxy.argv[-2:] == ["--auto-stall-weight", "2"]
    assert "--auto-stall-weight" not in fleet.deployments["push"].proxy.argv


def test_routes_forced_on_the_auto_deployment_are_compared_with_auto(tmp_path: Path):
    """auto@push etc. run on auto's own processes: the summary compares auto with the fastest of them,
    the findings count the cells, and the fleet starts no deployment of their own."""
    from kvpush.bench.loadgen import _headers
    from kvpush.bench.suite import Fleet, SuiteConfig

    runs = {"push": runs_of(100), "auto": runs_of(150), "auto@push": runs_of(100),
            "auto@pull": runs_of(120), "auto@push-layerwise": runs_of(130)}
    s = summarize(Cell("full", 512, 32, 0.5, "none"), 1.0, runs, {"push": 30})
    assert s["auto_vs_forced"]["best"] == "auto@push"
    assert s["auto_vs_forced"]["ttft_p50"]["ratio"] == pytest.approx(1.5, rel=0.02)
    assert s["auto_vs_forced"]["ttft_p50"]["verdict"] == "auto@push better"
    text = findings({"cells": [s]})
    assert "auto vs the best route forced on its own deployment (TTFT p50)**: worse beyond the interval in 1 of 1" in text
    assert "auto_vs_forced" not in summarize(Cell("full", 512, 32, 0.5, "none"), 1.0,
                                             {"push": runs["push"], "auto": runs["auto"]}, {})
    assert _headers(None, "pull")["X-KVPush-KV-Mode"] == "pull" and "X-KVPush-KV-Mode" not in _headers(None)
    fleet = Fleet(SuiteConfig(model="m", modes=("push", "auto", "auto@push")), str(tmp_path))
    assert set(fleet.deployments) == {"push", "auto"}
    assert set(Fleet(SuiteConfig(model="m", modes=("push", "auto@push")), str(tmp_path)).deployments) == {"push", "auto"}
    from kvpush.bench.suite import bench_args

    cfg = SuiteConfig(model="m")
    assert bench_args(cfg, "http://x", "auto@pull", 1.0, 0).kv_route == "pull"  # every run of it: map, capacity, suite
    assert bench_args(cfg, "http://x", "auto", 1.0, 0).kv_route is None


def test_link_only_maps_the_slow_link_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """--link-only skips the full-speed grid; without a link the full grid runs regardless. (The links and
    fleets are stood in for: this checks which grids run, tests/test_netlink.py the link itself.)"""
    import kvpush.bench.regime as regime
    import kvpush.launcher.netlink as netlink

    mapped: list[str] = []
    monkeypatch.setattr(regime, "map_link", lambda cfg, name, link, results, save, calibration: mapped.append(name))
    monkeypatch.setattr(netlink, "require_root", lambda: None)

    class Link:
        def __init__(self, config: object) -> None:
            pass

        def start(self) -> Link:
            return self

        def close(self) -> None:
            mapped.append("closed")

    monkeypatch.setattr(netlink, "RateLimitedLink", Link)
    for full_link, gbps, expect in ((False, 0.25, ["0.25 Gbit/s", "closed"]),
                                    (True, 0.25, ["full", "0.25 Gbit/s", "closed"]), (False, None, ["full"])):
        mapped.clear()
        regime.run_map(MapConfig(model="m", link_gbps=gbps, full_link=full_link, result_dir=str(tmp_path)))
        assert mapped == expect


def test_a_map_of_the_slow_link_alone_has_its_own_readme_section(tmp_path: Path):
    cfg = {**MapConfig(model="m", link_gbps=0.25, full_link=False).__dict__}
    doc = {"config": cfg, "elapsed_s": 60, "cells": [cell_summary(100, 150, 100)]}
    path = tmp_path / "regime_map.json"
    path.write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    quick, link = markers("quick"), markers("quick-link")
    readme.write_text(f"{quick[0]}\nquick text\n{quick[1]}\n\n{link[0]}\nold link text\n{link[1]}\n")
    report(path, readme, Path("docs/img/regime_map.png"))
    body = readme.read_text()
    assert "quick text" in body and "old link text" not in body
    assert (tmp_path / "docs/img/regime_map_quick-link.png").exists()


def test_the_report_says_which_processes_the_check_restarted():
    from kvpush.bench.regime_report import calibration_lines

    assert calibration_lines({"cells": []}) == []
    ok = {"probes": {}, "slow": {}, "restarted": []}
    slow = {"probes": {}, "slow": {"auto": "step 5.34 ms > 1.15 x median 3.98"}, "restarted": ["auto"]}
    still = {"probes": {}, "slow": {"auto": "step 5.1 ms > 1.15 x median 3.9"}, "restarted": []}
    assert "no restart" in calibration_lines({"calibration": {"full 128/32": [ok]}})[0]
    line = calibration_lines({"calibration": {"full 128/32": [ok], "full 512/32": [slow, still]}})[0]
    assert "full 512/32: auto (step 5.34 ms > 1.15 x median 3.98)" in line
    assert "still slow after its restarts, measured as it was: full 512/32: auto" in line


def test_a_map_of_some_rows_runs_those_rows_and_has_its_own_readme_section():
    from kvpush.bench.regime import grid_rows
    from kvpush.bench.regime_report import section_name

    full = MapConfig(model="m", grid="full")
    assert grid_rows(full)[0] == (128, 32) and len(grid_rows(full)) == 6
    some = MapConfig(model="m", grid="full", rows=("2048/256", "128/32"))
    assert grid_rows(some) == [(128, 32), (2048, 256)]  # the grid's order
    assert section_name({**full.__dict__}) == "full"
    assert section_name({**some.__dict__}) == "full-2048x256-128x32"
    assert section_name({**some.__dict__, "confirm_of": "x/regime_map.json"}) == "full-2048x256-128x32-confirm"


def test_a_map_of_some_loads_and_prefixes_runs_those_cells_alone():
    from kvpush.bench.regime import cells_for
    from kvpush.bench.regime_report import section_name

    assert len(cells_for(MapConfig(model="m", grid="full"), "full", 128, 256)) == 6
    cfg = MapConfig(model="m", grid="full", loads=(0.8,), prefixes=("none",))
    assert cells_for(cfg, "full", 128, 256) == [Cell("full", 128, 256, 0.8, "none")]
    assert section_name({**cfg.__dict__, "rows": ("128/256",)}) == "full-128x256-80%-none"


def test_a_route_forced_on_an_auto_deployment_of_its_own_is_paired_with_the_fixed_mode():
    """With nothing else on the auto deployment, auto@push gets push's prompts (its caches never saw
    them) and the summary says what the all-modes deployment costs the route; next to auto it cannot."""
    from kvpush.bench.regime import paired_forced, run_seed

    alone = MapConfig(model="m", modes=("push", "auto@push"))
    assert run_seed(alone, 3, 1, "auto@push") == run_seed(alone, 3, 1, "push")
    assert paired_forced(alone) == ("auto@push",)
    assert paired_forced(MapConfig(model="m", modes=("push", "auto", "auto@push"))) == ()
    shared = MapConfig(model="m", modes=("push", "auto@push", "auto@pull"))
    assert run_seed(shared, 3, 1, "auto@push") != run_seed(shared, 3, 1, "push")
    assert run_seed(MapConfig(model="m"), 3, 1, "auto@push") != run_seed(MapConfig(model="m"), 3, 1, "push")
    runs = {"push": [run(spread(100))], "auto@push": [run(spread(110))]}
    assert "forced_vs_fixed" not in summarize(Cell("full", 128, 256, 0.8, "none"), 1.0, runs, {})  # not paired
    s = summarize(Cell("full", 128, 256, 0.8, "none"), 1.0, runs, {}, paired_forced=("auto@push",))
    r = s["forced_vs_fixed"]["auto@push"]["ttft_p50"]
    assert r["ratio"] == pytest.approx(1.1, rel=0.02) and r["verdict"] == "push better"
    assert "auto_vs_forced" not in s and "auto_vs_best" not in s
    assert "auto@push: TTFT p50 1.1" in findings({"cells": [s]})


def test_an_auto_variant_is_its_own_deployment_compared_with_auto_and_each_fixed_mode(tmp_path: Path):
    """--auto-variant w3=FLAGS adds mode auto+w3: an auto deployment of its own whose proxy gets auto's
    extra flags, then FLAGS (which override them); the summary compares it with auto and each fixed
    mode on the same prompts, counts its routes from its answers, the findings print a line per
    variant with its flags, and the README section is not the map's own."""
    from kvpush.bench.suite import Fleet, SuiteConfig

    cfg = SuiteConfig(model="m", modes=("push", "auto", "auto+w3"), auto_proxy_args=["--auto-local-share", "0.5"],
                      auto_variants={"w3": ["--auto-stall-weight", "3"]})
    fleet = Fleet(cfg, str(tmp_path))
    variant = fleet.deployments["auto+w3"]
    assert variant.proxy.argv[-4:] == ["--auto-local-share", "0.5", "--auto-stall-weight", "3"]
    assert all(i.argv[i.argv.index("--kv-mode") + 1] == "auto" for i in variant.instances)
    assert "--auto-stall-weight" not in fleet.deployments["auto"].proxy.argv

    w3 = [run(spread(200))]
    for i, r in enumerate(w3[0]["requests"]):
        r["kvpush_route"] = {"route": "local" if i % 3 == 0 else "push"}
    runs = {"pull": [run(spread(100))], "push": [run(spread(110))], "auto": [run(spread(100))], "auto+w3": w3}
    s = summarize(Cell("full", 512, 32, 0.7, "mixed"), 5.0, runs, {"push": 30})
    v = s["variants"]["auto+w3"]
    assert v["routes"]["local"] == 10 and v["routes"]["push"] == 20 and v["routes"]["pull"] == 0
    assert v["vs_auto"]["ttft_p50"]["ratio"] == pytest.approx(2.0, rel=0.02)
    assert v["vs_auto"]["ttft_p50"]["verdict"] == "auto better"
    assert set(v["vs_each"]) == {"pull", "push"}
    assert s["auto_vs_best"]["best"] == "pull"  # a variant is no fixed mode
    text = findings({"config": {"auto_variants": {"w3": ["--auto-stall-weight", "3"]}}, "cells": [s]})
    assert "- **auto+w3** (auto with `--auto-stall-weight 3`) vs each mode (full 512/32 70% mixed): pull: TTFT p99" in text
    assert "routes of its measured requests push 20, local 10." in text
    assert section_name({"grid": "mixed", "auto_variants": {"w3": []}}) == "mixed-variants"
    assert section_name({"grid": "mixed", "auto_variants": {}}) == "mixed"


def test_auto_variant_flags_are_parsed_and_bad_names_refused():
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("regime_map_cli", Path(__file__).parents[1] / "benchmarks/regime_map.py")
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    ap = argparse.ArgumentParser()
    assert cli.parse_variants(ap, ["w3=--auto-stall-weight 3", "b_5=--auto-local-share=0.05",
                                   "pack=--prefill-join-tokens -1 --auto-stall-weight 1"]) == {
        "w3": ["--auto-stall-weight", "3"], "b_5": ["--auto-local-share=0.05"],
        "pack": ["--prefill-join-tokens", "-1", "--auto-stall-weight", "1"]}
    for bad in (["w3"], ["a b=--auto-stall-weight 1"], ["w3=--auto-stall-weight 1", "w3=--auto-stall-weight 2"],
                ["=--auto-stall-weight 1"], ["w3=--auto-stall-weigth 3"], ["w3=--kv-mode push"],
                ["w3=--auto-stall-weight -1"], ["j=--prefill-join-tokens x"], ["j=--port 1"],
                ["j=--prefill-join-tokens -3"], ["s=--max-num-seqs 0"], ["a=--prefill-join 5"]):
        with pytest.raises(SystemExit):
            cli.parse_variants(ap, bad)


def test_a_variants_scheduler_flags_go_to_its_instances_and_its_auto_flags_to_its_proxy():
    from kvpush.bench.suite import SuiteConfig, deployment_of

    cfg = SuiteConfig(model="m", modes=("auto", "auto+pack"), serve_args=["--torch-threads", "1"],
                      auto_proxy_args=["--auto-stall-weight", "3"],
                      auto_variants={"pack": ["--prefill-join-tokens", "-1", "--auto-stall-weight", "1"]})
    assert deployment_of(cfg, "auto+pack") == ("auto", ["--auto-stall-weight", "3", "--auto-stall-weight", "1"],
                                               ["--torch-threads", "1", "--prefill-join-tokens", "-1"])
    assert deployment_of(cfg, "auto") == ("auto", ["--auto-stall-weight", "3"], ["--torch-threads", "1"])
    assert deployment_of(cfg, "push") == ("push", [], ["--torch-threads", "1"])
    from kvpush.bench.suite import split_variant_flags

    assert split_variant_flags(["--auto-stall-weight", "1", "--max-num-seqs", "1", "--no-chunked-prefill",
                                "--prefill-join-tokens=5", "--auto-local-share=0.5"]) == (
        ["--auto-stall-weight", "1", "--auto-local-share=0.5"],
        ["--max-num-seqs", "1", "--no-chunked-prefill", "--prefill-join-tokens=5"])


def test_same_processes_runs_every_fixed_mode_as_a_route_on_autos_processes_on_autos_prompts():
    from kvpush.bench.regime import run_seed, same_processes_modes

    modes = same_processes_modes(("colocated", "pull", "push", "push-layerwise", "auto"))
    assert modes == ("colocated", "auto", "auto@pull", "auto@push", "auto@push-layerwise")
    assert same_processes_modes(("push", "auto")) == ("auto", "auto@push")
    cfg = MapConfig(model="m", modes=modes, reset_caches=True)  # caches reset before each run: paired prompts
    assert {run_seed(cfg, 3, 1, m) for m in modes} == {run_seed(cfg, 3, 1, "auto")}
    s = summarize(Cell("full", 128, 256, 0.8, "none"), 1.0, {"auto": [run(spread(105))], "auto@push": [run(spread(100))],
                                                             "auto@pull": [run(spread(120))]}, {})
    assert s["auto_vs_forced"]["best"] == "auto@push" and s["push_vs_pull"]["ttft_p50"]["verdict"] == "push better"
    assert set(s["auto_vs_each"]) == {"auto@push", "auto@pull"}  # the routes stand for the fixed modes
    assert s["auto_vs_each"]["auto@pull"]["ttft_p99"]["verdict"] == "auto better"


def test_mode_names_parse_into_deployment_route_and_twin():
    from kvpush.bench.modes import parse

    assert parse("auto@push#2").text == "auto@push#2" and parse("push").base == "push"
    n = parse("auto@push-layerwise#3")
    assert (n.deployment, n.route, n.twin, n.base, n.own_deployment) == ("auto", "push-layerwise", 3, "auto@push-layerwise",
                                                                         False)
    assert (parse("auto+w1").deployment, parse("auto+w1").own_deployment) == ("auto+w1", True)
    assert (parse("push#2").deployment, parse("push#2").route, parse("push#2").own_deployment) == ("push", None, False)
    for bad in ("auto@", "push#1", "push#", "push#x", "a@b@c", "", "auto push"):
        with pytest.raises(ValueError):
            parse(bad)


def test_a_twin_reruns_its_mode_on_the_same_prompts_and_processes_and_is_an_aa_check(tmp_path: Path):
    """MODE#2 runs on MODE's endpoint with MODE's route and prompts; the summary compares it with MODE
    (an A/A check, never a candidate for the best route) and the findings count its verdicts."""
    from kvpush.bench.regime import check_modes, run_seed
    from kvpush.bench.suite import Fleet, SuiteConfig, bench_args

    modes = ("auto", "auto@push", "auto@pull", "auto@push#2", "auto#2")
    cfg = MapConfig(model="m", modes=modes, reset_caches=True)
    check_modes(cfg)
    assert run_seed(cfg, 2, 1, "auto@push#2") == run_seed(cfg, 2, 1, "auto@push")
    shared = MapConfig(model="m", modes=modes)  # without the reset (refused below): still the base's prompts
    assert run_seed(shared, 2, 1, "auto@push#2") == run_seed(shared, 2, 1, "auto@push") != run_seed(shared, 2, 1, "auto")
    fleet = Fleet(SuiteConfig(model="m", modes=modes), str(tmp_path))
    assert set(fleet.deployments) == {"auto"}
    assert bench_args(SuiteConfig(model="m"), "http://x", "auto@push#2", 1.0, 0).kv_route == "push"
    assert bench_args(SuiteConfig(model="m"), "http://x", "auto#2", 1.0, 0).kv_route is None
    from kvpush.bench.cli import write_run
    from kvpush.bench.modes import is_auto

    assert write_run({}, tmp_path, "auto#2", 1.0).name.startswith("auto-twin2-rate1")  # not auto+2's auto_2
    assert is_auto("auto#2") and is_auto("auto+w1#2") and not is_auto("auto@push") and not is_auto("push#2")
    with pytest.raises(ValueError, match="reset"):
        check_modes(MapConfig(model="m", modes=("push", "push#2")))  # would be served from push's caches
    with pytest.raises(ValueError, match="not one of"):
        check_modes(MapConfig(model="m", modes=("auto", "auto@pull#2"), reset_caches=True))

    runs = {"auto": [run(spread(105))], "auto@push": [run(spread(100))], "auto@pull": [run(spread(120))],
            "auto@push#2": [run(spread(95))], "auto#2": [run(spread(140))]}  # the fastest: but no candidate
    s = summarize(Cell("full", 128, 256, 0.8, "none"), 1.0, runs, {})
    assert set(s["aa"]) == {"auto@push#2", "auto#2"}
    assert s["aa"]["auto@push#2"]["ttft_p50"]["verdict"] == "auto@push#2 better"  # 95 against 100
    assert s["aa"]["auto#2"]["ttft_p50"]["verdict"] == "auto better"  # 140 against 105: beyond
    assert s["aa"]["auto#2"]["ttft_p50"]["runs"] == 1
    assert s["auto_vs_forced"]["best"] == "auto@push" and set(s["auto_vs_each"]) == {"auto@push", "auto@pull"}
    text = findings({"cells": [s]})
    assert "- **A/A check** (auto#2, auto@push#2: each mode run twice" in text
    assert "1 run(s) a side): beyond the 95% interval in TTFT p50 2 of 2, TTFT p99 2 of 2, TPOT p50 0 of 2" in text


def test_a_one_run_map_says_its_verdicts_are_a_screen():
    from kvpush.bench.regime_report import section

    s = cell_summary(push=100, pull=150, auto=100)
    doc = {"config": {"grid": "quick", "modes": ["push", "pull", "auto"], "min_prompts": 12, "max_prompts": 40,
                      "repeats": 1}, "cells": [s]}
    assert "one run per mode: a screen" in section(doc, None)
    doc["config"]["repeats"] = 2
    assert "a screen" not in section(doc, None)


def test_losses_are_set_against_what_chance_gives_where_nothing_differs():
    from kvpush.bench.regime_report import by_chance

    assert by_chance(0, 0) == ""
    assert "0.3 expected, 0 or more with chance 1.00" in by_chance(0, 12)
    # 3 of 12: 1 - P(0) - P(1) - P(2) of Binomial(12, 0.025) = 0.0032
    assert "3 or more with chance 0.00 or more)" in by_chance(3, 12)
    assert "1 or more with chance 0.26 or more)" in by_chance(1, 12)
    text = findings({"cells": [cell_summary(push=100, pull=150, auto=160)]})
    assert "1 of 1 cell(s): full 512/32 50% none; better in 0 (where nothing differs" in text


def test_a_difference_on_too_few_runs_is_a_screen_and_not_counted():
    """One run a side: a TTFT p50 beyond the interval is shown as a screen and counted as cannot tell;
    two runs a side make it a verdict for the p50, while TTFT p99 and TPOT need three."""
    one = summarize(Cell("full", 512, 32, 0.5, "none"), 1.0, {"push": [run(spread(100))], "pull": [run(spread(150))]}, {})
    r = one["push_vs_pull"]["ttft_p50"]
    assert r["verdict"] == "push better" and r["runs"] == 1 and r["screen"]
    text = findings({"cells": [one]})
    assert "push better in 0 cell(s)" in text and "cannot tell in 1 (1 difference(s) beyond the interval on fewer" in text
    assert "screen: push better" in markdown({"config": {"modes": ["push", "pull"]}, "cells": [one]})
    two = summarize(Cell("full", 512, 32, 0.5, "none"), 1.0, {"push": runs_of(100, 2), "pull": runs_of(150, 2)}, {})
    assert not two["push_vs_pull"]["ttft_p50"]["screen"] and two["push_vs_pull"]["ttft_p99"]["screen"]
    assert "push better in 1 cell(s)" in findings({"cells": [two]})
    other = [run(spread(150)[i::3], seed=10 + i) for i in range(3)]  # other prompts: unpaired, whatever the runs
    apart = summarize(Cell("full", 512, 32, 0.5, "none"), 1.0, {"push": runs_of(100), "pull": other}, {})
    assert apart["push_vs_pull"]["ttft_p50"]["verdict"] == "push better" and apart["push_vs_pull"]["ttft_p50"]["screen"]
    old = {**one, "push_vs_pull": {k: {kk: vv for kk, vv in r.items() if kk != "screen"}
                                   for k, r in one["push_vs_pull"].items()}}  # a map from before screens
    assert "push better in 0 cell(s)" in findings({"cells": [old]})


def test_capacity_probes_on_shared_processes_start_from_empty_caches(monkeypatch: pytest.MonkeyPatch):
    """Every capacity probe sends the same prompts: on one deployment's processes (--same-processes) the
    second would be served from the first's prefix caches, so each is preceded by a reset."""
    from types import SimpleNamespace

    from kvpush.bench import suite

    calls: list[str] = []
    monkeypatch.setattr(suite, "reset_prefix_caches", lambda url: calls.append(f"reset {url}"))

    def one_run(args, _i, _rate, _model):
        calls.append(f"probe {args.kv_route}")
        return {"metrics": {"request_throughput": 3.0 if args.kv_route == "pull" else 5.0}}, None

    monkeypatch.setattr(suite.bench_cli, "_one_run", one_run)
    fleet = SimpleNamespace(deployments={"auto": None}, urls={"auto": "u", "auto@pull": "u", "auto@push": "u"})
    cfg = suite.SuiteConfig(model="m")
    assert suite.measure_capacity(cfg, fleet, reset_caches=True) == 3.0  # type: ignore[arg-type]
    assert calls == ["reset u", "probe pull", "reset u", "probe push"]
    calls.clear()
    suite.measure_capacity(cfg, fleet)  # type: ignore[arg-type]
    assert calls == ["probe pull", "probe push"]


def emulated(doc: dict, valid: bool = True, scale: float = 10.0) -> dict:
    """A run document as `kvpush bench` writes it for emulated instances (bench/emulation.py's report)."""
    inst = {"url": "http://p", "profile": "qwen3-32b-h200-tp8", "time_scale": scale, "step_p50_s": 0.04,
            "lateness_p99_s": 0.001 if valid else 0.004, "valid": valid}
    return {**doc, "emulation": {"profiles": ["qwen3-32b-h200-tp8"], "time_scales": [scale], "valid": valid,
                                 "instances": [inst], "unreachable": []}}


def test_an_emulated_cell_is_in_emulated_time_and_counts_its_valid_runs():
    """Times of emulated runs divide by the time scale (ratios do not move); the cell counts the runs that
    kept the clock, and the report says the map is emulated, in which rates and how many runs were valid."""
    runs = {"push": [emulated(r) for r in runs_of(1000)],
            "pull": [emulated(r, valid=i > 0) for i, r in enumerate(runs_of(3000))]}
    s = summarize(Cell("full", 1024, 128, 0.5, "held"), 0.5, runs, {})
    assert s["modes"]["push"]["ttft_p50_ms"] == pytest.approx(100) and s["modes"]["pull"]["tpot_p50_ms"] == pytest.approx(1)
    assert s["push_vs_pull"]["ttft_p50"]["ratio"] == pytest.approx(1 / 3)
    assert s["emulation"] == {"profiles": ["qwen3-32b-h200-tp8"], "time_scale": 10.0, "runs": 6, "valid_runs": 5,
                              "worst_lateness_p99_of_step": pytest.approx(0.1)}
    doc = {"config": MapConfig(model="m", grid="seed", emulate="qwen3-32b-h200-tp8", time_scale=10).__dict__,
           "elapsed_s": 60, "cells": [s]}
    table = markdown(doc)
    assert "| rate (emulated req/s) | valid runs |" in table and "| full 1024/128 50% held | 5.0 | 5/6 |" in table
    from kvpush.bench.regime_report import section
    assert "**EMULATED** (qwen3-32b-h200-tp8, time scale x10" in section(doc, None) and "5 of 6 runs valid" in section(doc, None)
    assert "emulation" not in summarize(Cell("full", 1024, 128, 0.5, "none"), 0.5, {"push": runs_of(10)}, {})
    with pytest.raises(ValueError, match="several time scales"):
        summarize(Cell("full", 1024, 128, 0.5, "none"), 0.5, {"push": [emulated(runs_of(10)[0], scale=40)],
                                                               "pull": [emulated(runs_of(10)[0])]}, {})


def test_proxy_args_reach_every_deployments_proxy_and_emulation_every_instance(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch):
    """--first-token (the seed grid: recompute) goes to every proxy; --emulate and --time-scale to every
    instance, colocated included (nothing is started: the fleet's processes are only described)."""
    from kvpush.bench.regime import start_fleet
    from kvpush.bench.suite import Fleet, SuiteConfig

    fleet = Fleet(SuiteConfig(model="m", modes=("colocated", "push", "auto"), proxy_args=["--first-token", "recompute"],
                              auto_proxy_args=["--auto-stall-weight", "2"]), str(tmp_path))
    assert fleet.deployments["push"].proxy.argv[-2:] == ["--first-token", "recompute"]
    assert fleet.deployments["auto"].proxy.argv[-4:] == ["--first-token", "recompute", "--auto-stall-weight", "2"]
    started: list[SuiteConfig] = []

    class Started:
        def __init__(self, base: SuiteConfig, log_dir: str, link: object) -> None:
            started.append(base)

        def start(self) -> Started:
            return self

    import kvpush.bench.regime as regime
    monkeypatch.setattr(regime, "Fleet", Started)
    start_fleet(MapConfig(model="m", emulate="qwen3-32b-h200-tp8", time_scale=40, result_dir=str(tmp_path),
                          proxy_args=["--first-token", "recompute"]), "full", None)
    # the KV deadline and lease (30 s each by default), D's quarantine (10 s) and the ledger's tombstones (300 s)
    # stretched by the time scale; --serve-args after them win
    assert started[0].serve_args == ["--emulate", "qwen3-32b-h200-tp8", "--time-scale", "40", "--kv-timeout-s", "1200",
                                     "--kv-lease-s", "1200", "--kv-quarantine-s", "400", "--kv-tombstone-s", "12000",
                                     "--torch-threads", "1"]
    assert started[0].proxy_args == ["--first-token", "recompute"]


def test_the_seed_grid_needs_an_emulated_profile(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("regime_map_cli2", Path(__file__).parents[1] / "benchmarks/regime_map.py")
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    for argv, message in ((["--seed-grid"], "--seed-grid needs --emulate"),
                          (["--seed-grid", "--emulate", "x", "--time-scale", "0"], "--time-scale must be positive"),
                          (["--seed-grid", "--emulate", "x", "--prefixes", "sessions"], "none held")):
        monkeypatch.setattr(sys, "argv", ["regime_map.py", *argv])
        with pytest.raises(SystemExit):
            cli.main()
        assert message in capsys.readouterr().err


def test_held_prompts_are_served_once_first_and_only_held_forgets_them_on_prefill(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch):
    """"held": a warm run of the same prompts, then P's prefix cache reset (D holds them, P none);
    "held-both": no reset. The warm run is written apart and not reported (nothing is started here)."""
    import kvpush.bench.regime as regime
    from kvpush.bench.suite import Fleet, SuiteConfig, bench_args

    fleet = Fleet(SuiteConfig(model="m", modes=("push",)), str(tmp_path))
    fleet.urls["push"] = "http://proxy"
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(regime.bench_cli, "_one_run",
                        lambda args, k, rate, model: calls.append(("run", args.mode_label, str(args.seed),
                                                                   args.result_dir)) or ({}, None))
    import kvpush.bench.regime_cells as cells
    monkeypatch.setattr(cells, "reset_prefix_caches", lambda url: calls.append(("reset", url)))
    monkeypatch.setattr(regime, "_routes", lambda url: {})
    cfg = MapConfig(model="m", grid="seed", modes=("push",), result_dir=str(tmp_path))
    suite = SuiteConfig(model="m")
    p_url = fleet.deployments["push"].of_role("prefill")[0].url
    for prefix, resets in (("held", [("reset", p_url)]), ("held-both", []), ("none", [])):
        calls.clear()
        regime._run_mode(cfg, suite, fleet, Cell("full", 1024, 64, 0.5, prefix), 1.0, "push", 7)
        runs = [c for c in calls if c[0] == "run"]
        assert [c for c in calls if c[0] == "reset"] == resets
        if prefix == "none":
            assert runs == [("run", "push", "7", str(tmp_path / "runs/full"))]
            continue
        assert runs == [("run", "push-warm", "7", str(tmp_path / "runs/full/held-warm")),
                        ("run", "push", "7", str(tmp_path / "runs/full"))]  # the same prompts, the warm run apart
        assert calls.index(runs[0]) < calls.index(runs[1]) and (not resets or calls[1] == resets[0])
    assert bench_args(suite, "http://x", "push", 1.0, 7).seed == 7
