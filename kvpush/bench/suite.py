"""Push vs pull vs colocated, side by side: start one deployment per mode, then load each in turn.

    STARTING (colocated server; 1P1D push + proxy; 1P1D pull + proxy; all healthy)
    -> CALIBRATED (with cfg.calibrate: every deployment probed, one on a slow process restarted)
    -> MEASURING (idle CPU of every instance; then per repeat and rate, each mode in rotating
       order on the same prompts; one run JSON each) -> REPORT (table, breakdown, PNGs)
    -> STOPPED (every process, also on error or Ctrl-C)

All deployments stay up for the whole suite, so modes alternate within a repeat and see the same
machine load; a repeat draws fresh prompts, so prefix caches do not flatter later repeats.
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.bench import cli as bench_cli
from kvpush.bench.calibrate import CalibrationConfig, calibrate
from kvpush.bench.compare import compare
from kvpush.bench.modes import parse, variant_name
from kvpush.bench.report import format_handover, format_phases, format_table, load_run
from kvpush.flags import add_auto_arguments, add_scheduler_arguments, scheduler_config_from_args
from kvpush.launcher.launch import ServerProcess, free_port
from kvpush.launcher.up import Deployment

if TYPE_CHECKING:
    from kvpush.launcher.netlink import RateLimitedLink

MODES = ("colocated", "pull", "push")
AVOID_IDS = (0, 1, 2)  # the tokenizer's special tokens: never drawn into a random prompt
SPECIAL_IDS = ",".join(map(str, AVOID_IDS))  # the same, as `kvpush bench --avoid-token-ids` takes it


@dataclass
class SuiteConfig:
    model: str
    modes: tuple[str, ...] = MODES
    rates: tuple[float, ...] = (1.0,)
    num_prompts: int = 20
    num_warmups: int = 2
    input_len: int = 512
    output_len: int = 32
    dataset: str = "random"  # kvpush bench --dataset: random, or mixed (short, long and multi-turn prompts)
    repeats: int = 1
    seed: int = 0
    result_dir: str = "kvpush-results"
    serve_args: list[str] = field(default_factory=list)
    vocab_size: int = 8192
    idle_probe_s: float = 3.0
    # Non-empty: the rates are these fractions of the measured 1P1D capacity (see measure_capacity).
    capacity_fractions: tuple[float, ...] = ()
    capacity_prompts: int = 48
    progress: bool = False
    pin: bool = False  # P and D on separate halves of the cores (see kvpush.launcher.placement)
    auto_proxy_args: list[str] = field(default_factory=list)  # extra `kvpush proxy` flags of the auto deployment
    # auto+NAME modes: a deployment of its own each, an auto proxy with auto_proxy_args and then these flags
    # (its --auto-* ones; scheduler flags among them go to its instances after serve_args: split_variant_flags)
    auto_variants: dict[str, list[str]] = field(default_factory=dict)
    calibrate: bool = False  # run_suite: check the processes first, restart a slow one (bench/calibrate.py)
    proxy_args: list[str] = field(default_factory=list)  # extra `kvpush proxy` flags of every deployment


def split_variant_flags(flags: list[str]) -> tuple[list[str], list[str]]:
    """An auto variant's flags -> (the proxy's --auto-* flags, the instances' scheduler flags), each in
    the order given. Raises ValueError naming a flag that is neither, or a value a parser or
    SchedulerConfig refuses (as `kvpush serve` would at start)."""
    proxy_parser, serve_parser = (argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
                                  for _ in range(2))
    add_auto_arguments(proxy_parser)
    add_scheduler_arguments(serve_parser)
    try:  # each parser leaves the other's flags, with their values, in the order given
        _, serve = proxy_parser.parse_known_args(flags)
        values, proxy = serve_parser.parse_known_args(flags)
        _, unknown = serve_parser.parse_known_args(serve)
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
    if unknown:
        raise ValueError(f"not a proxy --auto-* flag nor a scheduler flag of `kvpush serve`: {' '.join(unknown)}")
    scheduler_config_from_args(values)
    return proxy, serve


def deployment_of(cfg: SuiteConfig, mode: str) -> tuple[str, list[str], list[str]]:
    """The --kv-mode, the extra proxy flags and the serve flags of a mode's deployment."""
    name = variant_name(mode)
    if name is not None:  # auto's own extra flags first: the variant's override them (the last wins)
        proxy, serve = split_variant_flags(cfg.auto_variants[name])
        return "auto", [*cfg.proxy_args, *cfg.auto_proxy_args, *proxy], [*cfg.serve_args, *serve]
    return mode, [*cfg.proxy_args, *(cfg.auto_proxy_args if mode == "auto" else [])], list(cfg.serve_args)


class Fleet:
    """One serving endpoint per mode, started together and stopped together."""

    def __init__(self, cfg: SuiteConfig, log_dir: str, link: RateLimitedLink | None = None) -> None:
        """A colocated server and one 1P1D deployment per other mode (pull, push, push-layerwise, auto);
        with `link`, every deployment's P and D talk over it (the colocated server has no transfer)."""
        self.urls: dict[str, str] = {}
        # `deployment@route` (a route forced with X-KVPush-KV-Mode) and twins (`mode#2`, bench/modes.py) run on
        # another mode's deployment, with no processes of their own
        self.forced = [m for m in cfg.modes if not parse(m).own_deployment]
        self.colocated: ServerProcess | None = None
        self.deployments: dict[str, Deployment] = {}
        if "colocated" in cfg.modes:
            port = free_port()
            self.colocated = ServerProcess(["serve", cfg.model, "--port", str(port), *cfg.serve_args],
                                           log_path=os.path.join(log_dir, "colocated.log"))
        hosts = [parse(m).deployment for m in self.forced]  # a forced route alone still needs its deployment
        for mode in dict.fromkeys([*cfg.modes, *hosts]):
            if mode != "colocated" and mode not in self.forced:
                kv_mode, proxy_args, serve_args = deployment_of(cfg, mode)
                self.deployments[mode] = Deployment(cfg.model, 1, 1, kv_mode, free_port(), serve_args, proxy_args,
                                                    log_dir=os.path.join(log_dir, mode), pin=cfg.pin, link=link)

    def start(self) -> Fleet:
        try:
            if self.colocated is not None:
                self.colocated.start()
                self.colocated.wait_healthy(300)
                self.urls["colocated"] = self.colocated.url
            for mode, dep in self.deployments.items():
                dep.start()
                self.urls[mode] = dep.url
            for mode in self.forced:
                self.urls[mode] = self.urls[parse(mode).deployment]
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for dep in self.deployments.values():
            dep.stop()
        if self.colocated is not None:
            self.colocated.stop()

    def instances(self) -> dict[str, ServerProcess]:
        out = {"colocated": self.colocated} if self.colocated is not None else {}
        for mode, dep in self.deployments.items():
            for inst, role in zip(dep.instances, dep.roles, strict=True):
                out[f"{mode}-{role}"] = inst
        return out


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {pid}, {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - tree
        tree |= frontier
    return sorted(tree)


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and all its descendants."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def idle_cpu(fleet: Fleet, seconds: float) -> dict[str, float]:
    """Share of one core each idle instance (with its engine core and transfer thread) uses."""
    return idle_cpu_of({name: p.proc.pid for name, p in fleet.instances().items() if p.proc is not None}, seconds)


def idle_cpu_of(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Share of one core each named process tree uses over `seconds` (left idle by the caller)."""
    before = {name: process_tree_cpu(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {name: (process_tree_cpu(pid) - before[name]) / seconds for name, pid in pids.items()}


def bench_args(cfg: SuiteConfig, url: str, mode: str, rate: float, seed: int) -> argparse.Namespace:
    """`kvpush bench` arguments of one run of `mode` at `rate`; a forced route (`deployment@route`, also
    twinned) sends its route in every request (X-KVPush-KV-Mode)."""
    route = parse(mode).route
    parser = argparse.ArgumentParser()
    bench_cli.add_bench_arguments(parser)
    return parser.parse_args([
        "--base-url", url, "--result-dir", cfg.result_dir, "--dataset", cfg.dataset,
        "--input-len", str(cfg.input_len), "--output-len", str(cfg.output_len), "--ignore-eos",
        "--num-prompts", str(cfg.num_prompts), "--num-warmups", str(cfg.num_warmups),
        "--request-rate", str(rate), "--seed", str(seed), "--mode-label", mode,
        "--vocab-size", str(cfg.vocab_size), "--avoid-token-ids", SPECIAL_IDS,
        *([] if cfg.progress else ["--no-progress"]),
        *(["--kv-route", route] if route else []),
    ])


def reset_prefix_caches(url: str) -> None:
    """POST /reset_prefix_cache to an endpoint (a proxy resets its instances and its own tracking)."""
    req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def measure_capacity(cfg: SuiteConfig, fleet: Fleet, reset_caches: bool = False) -> float:
    """Completed requests per second of the slower 1P1D deployment, push or pull (else those routes forced
    on the auto deployment, else any deployment), when every request is sent at once (cfg.capacity_prompts
    of them, the suite's lengths): the rate both sustain. Every probe sends the same prompts: where two
    probes share processes (routes forced on one deployment) the second is served from the first's prefix
    caches unless `reset_caches` resets them before each (it was, until 2026-12-06: P prefilled push's
    probe of 16 x 512 tokens in 83 ms after pull's, ~1.5 s)."""
    measured = []
    modes = ([m for m in fleet.deployments if m in ("push", "pull")]
             or [m for m in fleet.urls if m in ("auto@push", "auto@pull")] or list(fleet.deployments))
    for mode in modes:
        if reset_caches:
            reset_prefix_caches(fleet.urls[mode])
        args = bench_args(cfg, fleet.urls[mode], mode, float("inf"), cfg.seed + 999_999)
        args.num_prompts, args.result_dir = cfg.capacity_prompts, os.path.join(cfg.result_dir, "capacity")
        doc, _ = bench_cli._one_run(args, 0, float("inf"), cfg.model)
        measured.append(float(doc["metrics"]["request_throughput"]))
    if not measured:
        raise ValueError("capacity fractions need a disaggregated mode (push or pull)")
    return min(measured)


def run_suite(cfg: SuiteConfig) -> tuple[list[Path], Path, list[Path]]:
    """Measure every mode at every rate; returns (run files, comparison table, plots)."""
    Path(cfg.result_dir).mkdir(parents=True, exist_ok=True)
    log_dir = os.path.join(cfg.result_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    fleet = Fleet(cfg, log_dir)
    print(f"kvpush suite: starting {', '.join(cfg.modes)} on {cfg.model} (logs in {log_dir})", flush=True)
    fleet.start()
    for mode, dep in fleet.deployments.items():
        print(f"{mode} placement: {'; '.join(dep.placement)}", flush=True)
    runs: list[Path] = []
    try:
        if cfg.calibrate:
            calibrate(fleet, CalibrationConfig.for_prompts(cfg.model, cfg.input_len, cfg.vocab_size), cfg.seed)
        cpu = idle_cpu(fleet, cfg.idle_probe_s)
        print("idle CPU (share of one core): " + ", ".join(f"{k} {v:.1%}" for k, v in cpu.items()), flush=True)
        rates = cfg.rates
        if cfg.capacity_fractions:
            capacity = measure_capacity(cfg, fleet)
            rates = tuple(round(f * capacity, 3) for f in cfg.capacity_fractions)
            print(f"1P1D capacity {capacity:.2f} req/s -> rates " + ", ".join(
                f"{r} ({f:.0%})" for r, f in zip(rates, cfg.capacity_fractions, strict=True)), flush=True)
        for rep in range(cfg.repeats):
            for k, rate in enumerate(rates):
                order = cfg.modes[rep % len(cfg.modes):] + cfg.modes[: rep % len(cfg.modes)]
                seed = cfg.seed + 1000 * rep + k
                for mode in order:
                    args = bench_args(cfg, fleet.urls[mode], mode, rate, seed)
                    _, path = bench_cli._one_run(args, 0, rate, cfg.model)
                    runs.append(path)
    finally:
        fleet.stop()
    md, pngs = compare([str(p) for p in runs], os.path.join(cfg.result_dir, "compare"))
    docs = [load_run(str(p)) for p in runs]
    print(format_table(docs))
    print(format_phases(docs))
    print(format_handover(docs))
    return runs, md, pngs
