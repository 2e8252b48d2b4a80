"""The `kvpush` command: serve | proxy | up | bench | demo | make-model | env | profile.

Defaults come from the config dataclasses; this module only maps flags onto them.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvpush.argtypes import positive_float, positive_int
from kvpush.config import EmulationConfig, FirstToken, KVMode, ProxyConfig
from kvpush.errors import KVPushError
from kvpush.flags import (
    AUTO_FLAGS,
    DEMO_RATES,
    PRESETS,
    HelpFormatter,
    _check_device,
    add_engine_arguments,
    add_proxy_arguments,
    add_server_arguments,
    add_transfer_arguments,
    engine_config_from_args,
    server_config_from_args,
    transfer_config_from_args,
    up_parser,
)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvpush.instance.serve import run_serve

    run_serve(engine_config_from_args(args), server_config_from_args(args), transfer_config_from_args(args))
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvpush.proxy.proxy import serve_proxy

    if not args.prefill or not args.decode:
        raise SystemExit("kvpush proxy: give at least one --prefill URL and one --decode URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ProxyConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), host=args.host,
                         port=args.port, kv_mode=KVMode(args.kv_mode), first_token=FirstToken(args.first_token),
                         policy=args.policy, api_key=args.api_key, instance_api_key=args.instance_api_key,
                         probe_interval_s=args.probe_interval_s, probe_timeout_s=args.probe_timeout_s,
                         probe_misses=args.probe_misses, auto_stall_weight=args.auto_stall_weight,
                         auto_local_max_ms=args.auto_local_max_ms, auto_local_share=args.auto_local_share,
                         auto_local_window_s=args.auto_local_window_s, auto_near_tie=args.auto_near_tie,
                         auto_residual_alpha=args.auto_residual_alpha, auto_switch_margin=args.auto_switch_margin,
                         auto_busy_period=args.auto_busy_period)
    asyncio.run(serve_proxy(config))
    return 0


def cmd_up(args: argparse.Namespace, serve_args: list[str]) -> int:
    from kvpush.launcher.up import run_up

    if args.prefill < 1 or args.decode < 1:
        raise SystemExit("kvpush up: --prefill and --decode must be at least 1")
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise SystemExit("kvpush up: --link-gbps must be positive")
    proxy_args = ["--first-token", args.first_token, "--policy", args.policy]
    for name in AUTO_FLAGS:  # kvpush's proxy takes them in every mode (vllm-router gets --policy only)
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        proxy_args += ([flag] if value else []) if isinstance(value, bool) else [flag, repr(value)]
    if args.pin and "--cpus" in serve_args:
        raise SystemExit("kvpush up: --pin chooses each instance's --cpus; give one or the other")
    link_gbps, delay_ms = args.link_gbps, 0.0
    emulated = emulated_link(serve_args, min(args.prefill, args.decode)) if args.emulated_link == "profile" else None
    if emulated is not None:
        if os.geteuid() != 0:
            raise SystemExit("kvpush up: --emulate joins P and D by the profile's link, which needs root (network "
                             "namespaces and tc): run as root, or add --emulated-link off (KV at this host's speed)")
        what = emulated[2] if link_gbps is None else f"--link-gbps {link_gbps:g}; the profile's latency"
        link_gbps, delay_ms = (link_gbps or emulated[0]), emulated[1]
        print(f"kvpush up: emulated link ({what}): {link_gbps:g} Gbit/s each way, {delay_ms:g} ms one way; "
              f"--emulated-link off for none", flush=True)
    try:
        return run_up(args.model, args.prefill, args.decode, args.kv_mode, args.port, serve_args, proxy_args,
                      link_gbps=link_gbps, router=args.router, pin=args.pin, link_delay_ms=delay_ms,
                      check_link=emulated is not None)
    except KVPushError as e:  # e.g. --link-gbps without root or iproute2
        hint = " (or --emulated-link off: transfers at this host's own speed)" if emulated is not None else ""
        print(f"kvpush up: error: {e}{hint}", file=sys.stderr)
        return 2


def emulated_link(serve_args: list[str], pairs: int = 1) -> tuple[float, float, str] | None:
    """With --emulate among `serve_args`: the link P and D are joined by in emulated time (docs/emulation.md):
    (the profile's per-rank bandwidth times `pairs` (min(P, D): one shaped link carries every pair's
    transfers, as many ranks' NICs would) divided by --time-scale, Gbit/s each way; its one-way latency
    times --time-scale, ms; what it is); None without --emulate. A bad profile or time scale stops `up` here."""
    from kvpush.emulate.profile import ProfileError, load_profile

    pick = argparse.ArgumentParser(prog="kvpush up", add_help=False, allow_abbrev=False)
    pick.add_argument("--emulate")
    pick.add_argument("--time-scale", type=positive_float, default=EmulationConfig().time_scale)
    known, _ = pick.parse_known_args(serve_args)
    if known.emulate is None:
        return None
    try:
        link, s = load_profile(known.emulate).link, known.time_scale
    except ProfileError as e:
        raise SystemExit(f"kvpush up: --emulate: {e}") from None
    ranks = f" x {pairs} pairs" if pairs > 1 else ""
    return (link.bandwidth_gbps * pairs / s, link.latency_s * s * 1e3,
            f"{known.emulate}'s {link.bandwidth_gbps:g} Gbit/s{ranks} and {link.latency_s * 1e6:g} us, "
            f"time scale {s:g}")


def cmd_make_model(args: argparse.Namespace) -> int:
    from kvpush.models.make_model import make_model

    if args.init_device != "cpu":
        _check_device(args.init_device)
    path = make_model(args.out, preset=args.preset, seed=args.seed, dtype=args.dtype, init_device=args.init_device)
    print(f"kvpush: wrote {args.preset} model to {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvpush.bench.demo import run_demo

    return run_demo(args)


def cmd_env(args: argparse.Namespace) -> int:
    import json

    from kvpush.bench.machine import facts, format_text

    print(json.dumps(facts(), indent=1) if args.json else format_text(facts()))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Time kvpush's engine on a grid, fit an emulation clock, write the profile (emulate/measure.py)."""
    import json
    from pathlib import Path

    from kvpush.bench.machine import machine_line
    from kvpush.emulate.measure import describe, grid, make_profile, time_steps
    from kvpush.emulate.profile import Link, load_profile
    from kvpush.engine.engine import LLMEngine

    if args.emulate is not None:
        raise SystemExit("kvpush: profile measures the real engine: it does not take --emulate")
    engine = LLMEngine(engine_config_from_args(args))
    steps = grid(engine.max_model_len, args.quick)
    lay = engine.layout
    points = time_steps(engine.runner, lay.block_size, lay.num_blocks, engine.arch.vocab_size, steps, args.repeats)
    command = "kvpush " + " ".join(getattr(args, "argv", None) or ["profile", args.model])
    machine = machine_line().removeprefix("machine: ")
    profile = make_profile(args.name or Path(args.out).stem, engine, points,
                           Link(args.link_gbps, args.link_latency_us * 1e-6), command, machine)
    Path(args.out).write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    load_profile(args.out)  # it reads back as a profile: `--emulate FILE` takes it
    print(f"{machine}\n| step | measured ms | formula ms | formula / measured |\n|---|---|---|---|")
    for p in points:
        fitted = profile.clock.formula_time(p.step)
        print(f"| {describe(p.step)} | {p.measured_s * 1e3:.2f} | {fitted * 1e3:.2f} | {fitted / p.measured_s:.2f} |")
    print("(the clock follows the measured steps where the formula misses: clock.grid, docs/emulation.md)")
    print(f"wrote {args.out} (kvpush serve MODEL --emulate {args.out})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", formatter_class=HelpFormatter)
    p.add_argument("model", help="checkpoint directory (Hugging Face format)")
    add_engine_arguments(p)
    add_server_arguments(p)
    add_transfer_arguments(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("proxy", help="route requests over prefill and decode instances", formatter_class=HelpFormatter)
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances' base URLs (required)")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances' base URLs (required)")
    add_proxy_arguments(p)
    p.set_defaults(func=cmd_proxy)
    sub.add_parser("up", help="start a local xPyD deployment (see `kvpush up --help`)", add_help=False)
    p = sub.add_parser("make-model", help="write a random-weight Qwen3 checkpoint", formatter_class=HelpFormatter)
    p.add_argument("out", help="directory to write the checkpoint to")
    p.add_argument("--preset", choices=PRESETS, default="tiny", help="model size (bench: the demo's and benchmarks' model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="dtype of the weights")
    p.add_argument("--init-device", default="cpu",
                   help="where gpu-1b's weights are drawn (cuda: seconds instead of a minute); other presets: cpu "
                        "(default: cpu)")
    p.set_defaults(func=cmd_make_model)
    p = sub.add_parser("demo", help="the README's main job: push vs pull vs colocated on the bench model",
                       formatter_class=HelpFormatter)
    p.add_argument("--model-dir", default=None,
                   help="where the demo model lives, created if missing (default: $KVPUSH_MODEL_DIR, else ./models)")
    p.add_argument("--result-dir", default="kvpush-results", help="where the runs, tables and plots go")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help=f"request rates in req/s (default: {' '.join(str(r) for r in DEMO_RATES)})")
    p.add_argument("--num-prompts", type=int, default=12, help="measured requests per mode and rate")
    p.add_argument("--no-pin", action="store_true", help="let P and D share cores (default: kvpush up --pin)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("env", help="the machine's facts that engine speed depends on (CPU, torch, kernels)",
                       formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print them as JSON, as benchmark runs record them")
    p.set_defaults(func=cmd_env)
    p = sub.add_parser("profile", help="time kvpush's engine on this machine into an emulation profile (--emulate FILE)",
                       formatter_class=HelpFormatter)
    p.add_argument("model", help="checkpoint directory (Hugging Face format)")
    p.add_argument("-o", "--out", required=True, help="the profile to write (JSON, docs/emulation.md's format)")
    p.add_argument("--name", default=None, help="the profile's name (default: the output file's name, less .json)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed passes over the grid, each point's median (default: 5)")
    p.add_argument("--quick", action="store_true",
                   help="a small grid of short prompts, for tests (default: prefills to 2,048 tokens, decode batches "
                        "to 32)")
    p.add_argument("--link-gbps", type=positive_float, default=10.0,
                   help="the emulated link's bandwidth per rank, Gbit/s; not measured (default: 10)")
    p.add_argument("--link-latency-us", type=positive_float, default=50.0,
                   help="the emulated link's one-way latency, us; not measured (default: 50)")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_profile)
    _add_bench(sub)
    return parser


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its name (`serve`, `proxy`, `up`, ..., `bench compare`): docs/configuration.md
    is generated from these (scripts/configuration_md.py)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {name: p for name, p in sub.choices.items() if name != "up"}
    out["up"] = up_parser()
    from kvpush.bench import cli as bench_cli

    compare = argparse.ArgumentParser(prog="kvpush bench compare", formatter_class=HelpFormatter)
    bench_cli.add_compare_arguments(compare)
    out["bench compare"] = compare
    return out


def _add_bench(sub) -> None:
    try:
        from kvpush.bench import cli as bench_cli
    except ImportError:
        return
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server", formatter_class=HelpFormatter)
    bench_cli.add_bench_arguments(p)
    p.set_defaults(func=bench_cli.run_bench)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "compare"]:
        return _compare(argv[2:])
    if argv[:1] == ["up"]:
        up_args, serve_args = up_parser().parse_known_args(argv[1:])
        return cmd_up(up_args, serve_args)
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    try:
        return int(args.func(args) or 0)
    except KVPushError as e:
        print(f"kvpush: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _compare(argv: list[str]) -> int:
    from kvpush.bench import cli as bench_cli

    p = argparse.ArgumentParser(prog="kvpush bench compare", formatter_class=HelpFormatter)
    bench_cli.add_compare_arguments(p)
    return int(bench_cli.run_compare(p.parse_args(argv)) or 0)


if __name__ == "__main__":
    sys.exit(main())
