"""The `kvpush` command: serve | proxy | up | bench | demo | make-model.

Defaults come from the config dataclasses; this module only maps flags onto them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from kvpush.argtypes import non_negative_float, positive_float, unit_fraction
from kvpush.config import (
    AdmissionConfig,
    CacheConfig,
    CompileMode,
    EngineConfig,
    Faults,
    FirstToken,
    KVMode,
    ModelConfig,
    OnKVFailure,
    ProxyConfig,
    Role,
    SchedulerConfig,
    ServerConfig,
    TransferConfig,
    compile_mode_default,
    torch_threads_default,
)
from kvpush.errors import KVPushError

PRESETS = ("tiny", "small", "bench", "gpu-1b")



def _default(cls, name: str):
    return next(f.default for f in fields(cls) if f.name == name)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default=_default(ModelConfig, "dtype"), choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=_default(ModelConfig, "device"),
                   help="cpu, cuda or cuda:N: where the model runs and the KV cache lives (NIXL: DRAM or VRAM)")
    g.add_argument("--max-model-len", type=int, default=_default(ModelConfig, "max_model_len"))
    g.add_argument("--block-size", type=int, default=_default(CacheConfig, "block_size"))
    g.add_argument("--num-blocks", type=int, default=_default(CacheConfig, "num_blocks"))
    g.add_argument("--kv-cache-memory-mb", type=int, default=_default(CacheConfig, "kv_cache_memory_mb"))
    g.add_argument("--no-prefix-caching", action="store_true")
    add_scheduler_arguments(g)
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: one per --cpus core, else $KVPUSH_TORCH_THREADS or 1)")
    g.add_argument("--seed", type=int, default=_default(EngineConfig, "seed"))
    g.add_argument("--compile", default=compile_mode_default().value, choices=[m.value for m in CompileMode],
                   help="torch.compile the model: auto (if inductor can build here), on (or fail), off")


def add_scheduler_arguments(g: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The engine's scheduling flags (`kvpush serve`; the regime map's --auto-variant takes them too)."""
    g.add_argument("--max-num-seqs", type=int, default=_default(SchedulerConfig, "max_num_seqs"))
    g.add_argument("--max-num-batched-tokens", type=int, default=_default(SchedulerConfig, "max_num_batched_tokens"))
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--prefill-join-tokens", type=int, default=_default(SchedulerConfig, "prefill_join_tokens"),
                   help="a prefill of more (uncached) tokens than this waits for the next step rather than join a step that "
                        "already computes one (every request of a step ends with it); -1: pack up to "
                        "--max-num-batched-tokens (vLLM); default: by device, 16 on a CPU, no limit on a GPU")
    g.add_argument("--long-prefill-token-threshold", type=int,
                   default=_default(SchedulerConfig, "long_prefill_token_threshold"),
                   help="a prefill computes at most this many tokens a step (chunks), so that requests decoding beside "
                        "it wait one chunk, not the whole prefill; 0: off; default: by role, "
                        "256 on a decode instance on a CPU (local prefills of --kv-mode auto, recomputes), off elsewhere")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    if args.torch_threads is None:
        cpus = getattr(args, "cpus", None)
        args.torch_threads = len(_cpus(cpus)) if cpus else torch_threads_default()
    _positive(args, "block_size", "torch_threads", "kv_cache_memory_mb")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise SystemExit("kvpush: --num-blocks must be at least 1")
    _check_device(args.device)
    try:
        scheduler = scheduler_config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"kvpush: {exc}") from None
    return EngineConfig(
        model=ModelConfig(args.model, args.dtype, args.device, args.max_model_len),
        cache=CacheConfig(args.block_size, args.num_blocks, args.kv_cache_memory_mb, not args.no_prefix_caching),
        scheduler=scheduler,
        torch_threads=args.torch_threads,
        seed=args.seed,
        compile=CompileMode(args.compile),
    )


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The flags of add_scheduler_arguments as a SchedulerConfig; ValueError on a value it refuses."""
    return SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, not args.no_chunked_prefill,
                           args.prefill_join_tokens, args.long_prefill_token_threshold)


def _check_device(name: str) -> None:
    """Fail before any process starts when --device names a GPU this machine lacks (cpu: no torch import)."""
    if name == "cpu":
        return
    from kvpush.device import resolve_device
    from kvpush.errors import DeviceError

    try:
        resolve_device(name)
    except DeviceError as e:
        raise SystemExit(f"kvpush: {e}") from e


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"kvpush: --{name.replace('_', '-')} must be at least 1")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default=_default(ServerConfig, "host"))
    g.add_argument("--port", type=int, default=_default(ServerConfig, "port"))
    g.add_argument("--role", default=_default(ServerConfig, "role").value, choices=[r.value for r in Role])
    g.add_argument("--api-key", default=None)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--cpus", default=None, metavar="LIST",
                   help="run this instance's processes and threads only on these CPUs, e.g. 0-3,6")
    g.add_argument("--shutdown-timeout", type=float, default=_default(ServerConfig, "shutdown_timeout_s"),
                   metavar="S", help="on SIGTERM: refuse new requests (503), let running ones finish for at "
                   "most S seconds, then end the rest with an error and tell the peers")
    g = p.add_argument_group("admission (past these bounds a request gets 429 with Retry-After at once)")
    g.add_argument("--max-waiting", type=int, default=_default(AdmissionConfig, "max_waiting"),
                   help="requests queued beyond a full batch (--max-num-seqs)")
    g.add_argument("--max-waiting-tokens", type=int, default=_default(AdmissionConfig, "max_waiting_tokens"),
                   help="prompt tokens of requests that have no output token yet")
    g.add_argument("--kv-headroom", type=float, default=_default(AdmissionConfig, "kv_headroom"),
                   help="fraction of the KV cache kept free for running requests' growth")
    g.add_argument("--retry-after-s", type=int, default=_default(AdmissionConfig, "retry_after_s"),
                   help="Retry-After of a shed request")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    try:
        admission = AdmissionConfig(args.max_waiting, args.max_waiting_tokens, args.kv_headroom, args.retry_after_s)
        return ServerConfig(host=args.host, port=args.port, role=Role(args.role), api_key=args.api_key,
                            served_model_name=args.served_model_name, admission=admission,
                            cpus=_cpus(args.cpus) if args.cpus else (), shutdown_timeout_s=args.shutdown_timeout)
    except ValueError as e:
        raise SystemExit(f"kvpush: {e}") from e


def _cpus(text: str) -> tuple[int, ...]:
    from kvpush.placement import PlacementError, parse_cpus

    try:
        return parse_cpus(text)
    except PlacementError as e:
        raise SystemExit(f"kvpush: --cpus: {e}") from e


def add_transfer_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV transfer (prefill and decode roles)")
    g.add_argument("--kv-mode", default=_default(TransferConfig, "kv_mode").value, choices=[m.value for m in KVMode])
    g.add_argument("--kv-host", default=_default(TransferConfig, "kv_host"),
                   help="address the KV side channel (handshakes) binds to")
    g.add_argument("--kv-advertise-host", default=None,
                   help="address peers should connect to (default: --kv-host, or this host's name for 0.0.0.0)")
    g.add_argument("--kv-port", type=int, default=_default(TransferConfig, "kv_port"), help="0: a free port")
    g.add_argument("--kv-secret", default=None, help="shared secret authenticating handshakes (HMAC)")
    g.add_argument("--kv-lease-s", type=float, default=_default(TransferConfig, "kv_lease_s"))
    g.add_argument("--kv-timeout-s", type=float, default=_default(TransferConfig, "kv_timeout_s"))
    g.add_argument("--kv-quarantine-s", type=float, default=_default(TransferConfig, "kv_quarantine_s"))
    g.add_argument("--kv-writes-per-peer", type=int, default=_default(TransferConfig, "kv_writes_per_peer"),
                   help="prefill: whole-request WRITEs in flight to one decode instance at a time, the rest "
                        "queued in order (0: no limit)")
    g.add_argument("--on-kv-failure", default=_default(TransferConfig, "on_kv_failure").value,
                   choices=[m.value for m in OnKVFailure])
    g.add_argument("--fault-inject", action="append", default=[], metavar="NAME[:VALUE]",
                   help=f"testing only, repeatable: {', '.join(Faults.NAMES)}")


def transfer_config_from_args(args: argparse.Namespace) -> TransferConfig:
    faults = _faults(args.fault_inject)
    try:
        return TransferConfig(kv_mode=KVMode(args.kv_mode), kv_port=args.kv_port, kv_host=args.kv_host,
                              kv_advertise_host=args.kv_advertise_host, kv_quarantine_s=args.kv_quarantine_s,
                              kv_secret=args.kv_secret, kv_lease_s=args.kv_lease_s, kv_timeout_s=args.kv_timeout_s,
                              on_kv_failure=OnKVFailure(args.on_kv_failure), faults=faults,
                              kv_writes_per_peer=args.kv_writes_per_peer)
    except ValueError as e:
        raise SystemExit(f"kvpush: {e}") from e


def _faults(specs: list[str]) -> Faults:
    try:
        return Faults.parse(specs)
    except ValueError as e:
        raise SystemExit(f"kvpush: --fault-inject: {e}") from e


def cmd_serve(args: argparse.Namespace) -> int:
    from kvpush.server.serve import run_serve

    run_serve(engine_config_from_args(args), server_config_from_args(args), transfer_config_from_args(args))
    return 0


def add_proxy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_default(ProxyConfig, "host"))
    p.add_argument("--port", type=int, default=_default(ProxyConfig, "port"))
    p.add_argument("--kv-mode", default=_default(ProxyConfig, "kv_mode").value, choices=[m.value for m in KVMode])
    p.add_argument("--first-token", default=_default(ProxyConfig, "first_token").value,
                   choices=[m.value for m in FirstToken],
                   help="D recomputes the last prompt position, or uses the token P sampled")
    p.add_argument("--policy", default=_default(ProxyConfig, "policy"), choices=["round-robin", "least-loaded"])
    p.add_argument("--api-key", default=None, help="clients must send this Bearer token")
    p.add_argument("--instance-api-key", default=None, help="the Bearer token the instances expect")
    p.add_argument("--probe-interval-s", type=positive_float, default=_default(ProxyConfig, "probe_interval_s"),
                   help="how often the proxy asks every instance for /v1/kv_info (health, draining, restarts)")
    add_auto_arguments(p)


AUTO_FLAGS = ("auto_stall_weight", "auto_local_max_ms", "auto_local_share", "auto_local_window_s", "auto_near_tie",
             "auto_residual_alpha", "auto_switch_margin", "auto_busy_period")


def add_auto_arguments(p: argparse.ArgumentParser) -> None:
    """The proxy's --kv-mode auto flags (`kvpush proxy`, and `kvpush up`, which hands them to its proxy)."""
    p.add_argument("--auto-stall-weight", type=non_negative_float, default=_default(ProxyConfig, "auto_stall_weight"),
                   help="--kv-mode auto: weight of the stall a local prefill on D inflicts on D's running requests")
    p.add_argument("--auto-local-max-ms", type=non_negative_float, default=_default(ProxyConfig, "auto_local_max_ms"),
                   help="--kv-mode auto: D prefills a request itself only if that takes at most this long, or "
                        "if P's queue would hold the request at least as long as D's local queue and prefill")
    p.add_argument("--auto-local-share", type=non_negative_float, default=_default(ProxyConfig, "auto_local_share"),
                   help="--kv-mode auto: at most this share of each D's time goes to prefilling requests locally "
                        "(bounds what that adds to TPOT; 1: no limit, 0: only when no P is usable)")
    p.add_argument("--auto-local-window-s", type=positive_float,
                   default=_default(ProxyConfig, "auto_local_window_s"),
                   help="--kv-mode auto: the local share is kept over about this long (a burst may use it at once); "
                        "also the window of P's busy fraction (--auto-busy-period)")
    p.add_argument("--auto-near-tie", type=non_negative_float, default=_default(ProxyConfig, "auto_near_tie"),
                   help="--kv-mode auto: when a remote route is the cheapest, another remote route whose cost is "
                        "within this fraction of its cost is taken once 10 decisions went by without it, so that "
                        "near ties are measured (0: off)")
    p.add_argument("--auto-residual-alpha", type=unit_fraction, default=_default(ProxyConfig, "auto_residual_alpha"),
                   help="--kv-mode auto: weight of the newest answer in a route's correction of its fitted TTFT "
                        "(the queue ahead left out) by its recent measured/fitted ratio, per prompt size class (0: off)")
    p.add_argument("--auto-switch-margin", type=non_negative_float, default=_default(ProxyConfig, "auto_switch_margin"),
                   help="--kv-mode auto: another remote route replaces the one last chosen for prompts of the "
                        "request's size class only when its cost is lower by more than this fraction "
                        "(0: the cheapest always)")
    p.add_argument("--auto-busy-period", action="store_true",
                   help="--kv-mode auto: count the delay a prefill on P causes the requests behind it 1 / (1 - P's "
                        "busy fraction over --auto-local-window-s) times, at most 5, for the rest of P's busy period "
                        "(default: once)")


def cmd_proxy(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvpush.server.proxy import serve_proxy

    if not args.prefill or not args.decode:
        raise SystemExit("kvpush proxy: give at least one --prefill URL and one --decode URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ProxyConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), host=args.host,
                         port=args.port, kv_mode=KVMode(args.kv_mode), first_token=FirstToken(args.first_token),
                         policy=args.policy, api_key=args.api_key, instance_api_key=args.instance_api_key,
                         probe_interval_s=args.probe_interval_s, auto_stall_weight=args.auto_stall_weight,
                         auto_local_max_ms=args.auto_local_max_ms, auto_local_share=args.auto_local_share,
                         auto_local_window_s=args.auto_local_window_s, auto_near_tie=args.auto_near_tie,
                         auto_residual_alpha=args.auto_residual_alpha, auto_switch_margin=args.auto_switch_margin,
                         auto_busy_period=args.auto_busy_period)
    asyncio.run(serve_proxy(config))
    return 0


def cmd_up(args: argparse.Namespace, serve_args: list[str]) -> int:
    from kvpush.server.up import run_up

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
    try:
        return run_up(args.model, args.prefill, args.decode, args.kv_mode, args.port, serve_args, proxy_args,
                      link_gbps=args.link_gbps, router=args.router, pin=args.pin)
    except KVPushError as e:  # e.g. --link-gbps without root or iproute2
        print(f"kvpush up: error: {e}", file=sys.stderr)
        return 2


def up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpush up", description="start a local xPyD deployment plus proxy; "
                                "other flags are passed to every `kvpush serve`")
    p.add_argument("model")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--kv-mode", default=_default(ProxyConfig, "kv_mode").value, choices=[m.value for m in KVMode])
    p.add_argument("--port", type=int, default=_default(ProxyConfig, "port"))
    p.add_argument("--first-token", default=_default(ProxyConfig, "first_token").value,
                   choices=[m.value for m in FirstToken])
    p.add_argument("--policy", default=_default(ProxyConfig, "policy"), choices=["round-robin", "least-loaded"])
    p.add_argument("--router", default="kvpush", choices=["kvpush", "vllm-router"],
                   help="front door: kvpush's proxy, or vllm-router (pip install vllm-router; push: sequential)")
    p.add_argument("--link-gbps", type=float, default=None, metavar="G",
                   help="root only: run P and D in two network namespaces joined by a link of G Gbit/s each way")
    p.add_argument("--pin", action="store_true",
                   help="prefill instances on one half of the cores, decode instances on the other (proxy unpinned)")
    add_auto_arguments(p)
    return p


def cmd_make_model(args: argparse.Namespace) -> int:
    from kvpush.models.make_model import make_model

    if args.init_device != "cpu":
        _check_device(args.init_device)
    path = make_model(args.out, preset=args.preset, seed=args.seed, dtype=args.dtype, init_device=args.init_device)
    print(f"kvpush: wrote {args.preset} model to {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvpush.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", help="checkpoint directory (Hugging Face format)")
    add_engine_arguments(p)
    add_server_arguments(p)
    add_transfer_arguments(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("proxy", help="route requests over prefill and decode instances")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL")
    add_proxy_arguments(p)
    p.set_defaults(func=cmd_proxy)
    sub.add_parser("up", help="start a local xPyD deployment (see `kvpush up --help`)", add_help=False)
    p = sub.add_parser("make-model", help="write a random-weight Qwen3 checkpoint")
    p.add_argument("out")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--init-device", default="cpu",
                   help="where gpu-1b's weights are drawn (cuda: seconds instead of a minute); other presets: cpu")
    p.set_defaults(func=cmd_make_model)
    p = sub.add_parser("demo", help="the README's main job: push vs pull vs colocated on the bench model")
    p.add_argument("--model-dir", default=None, help="where the demo model lives (created if missing)")
    p.add_argument("--result-dir", default="kvpush-results")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="request rates (req/s)")
    p.add_argument("--num-prompts", type=int, default=12, help="measured requests per mode and rate")
    p.add_argument("--no-pin", action="store_true", help="let P and D share cores (default: kvpush up --pin)")
    p.set_defaults(func=cmd_demo)
    _add_bench(sub)
    return parser


def _add_bench(sub) -> None:
    try:
        from kvpush.bench import cli as bench_cli
    except ImportError:
        return
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server")
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
    try:
        return int(args.func(args) or 0)
    except KVPushError as e:
        print(f"kvpush: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _compare(argv: list[str]) -> int:
    from kvpush.bench import cli as bench_cli

    p = argparse.ArgumentParser(prog="kvpush bench compare")
    bench_cli.add_compare_arguments(p)
    return int(bench_cli.run_compare(p.parse_args(argv)) or 0)


if __name__ == "__main__":
    sys.exit(main())
