"""The flags of `kvpush serve`, `proxy` and `up`, and the configs they build.

Defaults come from the config dataclasses (kvpush/config.py); this module only maps flags onto them.
The command itself (kvpush/cli.py) and the benchmarks that start servers both use it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields

from kvpush.argtypes import non_negative_float, positive_float, positive_int, unit_fraction
from kvpush.config import (
    AdmissionConfig,
    AttentionPath,
    CacheConfig,
    CompileMode,
    EmulationConfig,
    EngineConfig,
    Faults,
    FirstToken,
    KVMode,
    LinearBackend,
    ModelConfig,
    OnKVFailure,
    ProxyConfig,
    Role,
    SchedulerConfig,
    ServerConfig,
    TransferConfig,
    compile_mode_default,
    decode_attention_default,
    linear_backend_default,
    prefill_attention_default,
    torch_threads_default,
)

PRESETS = ("tiny", "small", "bench", "gpu-1b")
DEMO_RATES = (1.0, 2.0, 4.0)  # `kvpush demo`'s request rates (req/s)



def _default(cls, name: str):
    return next(f.default for f in fields(cls) if f.name == name)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default=_default(ModelConfig, "dtype"), choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' and KV cache's dtype (auto: the checkpoint's torch_dtype)")
    g.add_argument("--device", default=_default(ModelConfig, "device"),
                   help="cpu, cuda or cuda:N: where the model runs and the KV cache lives (NIXL: DRAM or VRAM)")
    g.add_argument("--max-model-len", type=int, default=_default(ModelConfig, "max_model_len"),
                   help="longest prompt plus output, in tokens (default: the checkpoint's max_position_embeddings)")
    g.add_argument("--block-size", type=int, default=_default(CacheConfig, "block_size"),
                   help="tokens per KV block (P and D must agree)")
    g.add_argument("--num-blocks", type=int, default=_default(CacheConfig, "num_blocks"),
                   help="KV blocks to allocate (default: as many as --kv-cache-memory-mb holds)")
    g.add_argument("--kv-cache-memory-mb", type=int, default=_default(CacheConfig, "kv_cache_memory_mb"),
                   help="memory of the KV cache when --num-blocks is not given")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse cached prompt prefixes (default: reuse them)")
    add_scheduler_arguments(g)
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: one per --cpus core, else $KVPUSH_TORCH_THREADS or 1)")
    g.add_argument("--seed", type=int, default=_default(EngineConfig, "seed"),
                   help="seed of the sampler for requests that give none")
    g.add_argument("--compile", default=compile_mode_default().value, choices=[m.value for m in CompileMode],
                   help="torch.compile the model: auto (if inductor can build here), on (or fail), off "
                        "(default: $KVPUSH_COMPILE, else auto)")
    g.add_argument("--linear-backend", default=None, choices=[b.value for b in LinearBackend],
                   help="the linear layers' CPU backend: mkl (plain nn.Linear), onednn (weights packed once at "
                        "load), auto (time both on the model's shapes at start-up, keep the faster; cached per "
                        "CPU model and torch version) (default: $KVPUSH_LINEAR_BACKEND, else auto)")
    g.add_argument("--decode-attention", default=None, choices=[b.value for b in AttentionPath],
                   help="how decode rows attend on a CPU: kernel (a C kernel reads K/V in place; fp32), sdpa "
                        "(blocks gathered, one SDPA call), auto (time both on the model's shapes at start-up, keep "
                        "the faster; cached per CPU model and torch version) (default: $KVPUSH_DECODE_ATTENTION, "
                        "else auto)")
    g.add_argument("--prefill-attention", default=None, choices=[b.value for b in AttentionPath],
                   help="how prefill chunks attend on a CPU: kernel (one C call a chunk over its context; fp32, one "
                        "thread), sdpa (torch's SDPA: 64-row pieces or one causal call), auto (time both on the model's shapes at start-up, "
                        "keep the faster; cached per CPU model and torch version) (default: "
                        "$KVPUSH_PREFILL_ATTENTION, else auto)")
    g.add_argument("--emulate", default=None, metavar="PROFILE",
                   help="replace the model's forward by an emulated accelerator: a shipped profile's name "
                        "(qwen3-8b-h100, qwen3-32b-h200-tp8) or a profile file; MODEL supplies only the tokenizer; "
                        "docs/emulation.md (default: none, the real model)")
    g.add_argument("--time-scale", type=positive_float, default=_default(EmulationConfig, "time_scale"),
                   metavar="S", help="--emulate: stretch every modelled step time by S")


def _linear_backend(name: str | None) -> LinearBackend:
    """--linear-backend, else $KVPUSH_LINEAR_BACKEND (checked here, not when the parser is built), else auto."""
    try:
        return LinearBackend(name) if name else linear_backend_default()
    except ValueError as e:
        raise SystemExit(f"kvpush: $KVPUSH_LINEAR_BACKEND: {e}") from None


def add_scheduler_arguments(g: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The engine's scheduling flags (`kvpush serve`; the regime map's --auto-variant takes them too)."""
    g.add_argument("--max-num-seqs", type=int, default=_default(SchedulerConfig, "max_num_seqs"),
                   help="requests running at once (the batch)")
    g.add_argument("--max-num-batched-tokens", type=int, default=_default(SchedulerConfig, "max_num_batched_tokens"),
                   help="tokens computed in one step")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="a prompt longer than the step's token budget is not split over steps (default: split)")
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
    try:
        return EngineConfig(
            model=ModelConfig(args.model, args.dtype, args.device, args.max_model_len),
            cache=CacheConfig(args.block_size, args.num_blocks, args.kv_cache_memory_mb, not args.no_prefix_caching),
            scheduler=scheduler,
            torch_threads=args.torch_threads,
            seed=args.seed,
            compile=CompileMode(args.compile),
            linear_backend=_linear_backend(args.linear_backend),
            decode_attention=_attention_path(args.decode_attention, decode_attention_default,
                                             "KVPUSH_DECODE_ATTENTION"),
            prefill_attention=_attention_path(args.prefill_attention, prefill_attention_default,
                                              "KVPUSH_PREFILL_ATTENTION"),
            emulation=_emulation(args),
        )
    except ValueError as exc:
        raise SystemExit(f"kvpush: {exc}") from None


def _attention_path(name: str | None, default: Callable[[], AttentionPath], env: str) -> AttentionPath:
    """--decode-attention / --prefill-attention, else its environment variable (checked here), else auto."""
    try:
        return AttentionPath(name) if name else default()
    except ValueError as e:
        raise SystemExit(f"kvpush: ${env}: {e}") from None


def _emulation(args: argparse.Namespace) -> EmulationConfig:
    """--emulate and --time-scale; the profile is read here, so that a bad one stops `serve` before start-up."""
    if args.emulate is None:
        return EmulationConfig(time_scale=args.time_scale)
    from kvpush.emulate.profile import ProfileError, load_profile

    try:
        profile = load_profile(args.emulate)
    except ProfileError as e:
        raise SystemExit(f"kvpush: --emulate: {e}") from None
    memory = args.kv_cache_memory_mb << 20
    block = profile.kv.bytes_per_token * args.block_size
    if args.num_blocks is None and memory < block:
        raise SystemExit(f"kvpush: --emulate {args.emulate}: one KV block ({block >> 10} KiB at "
                         f"{profile.kv.bytes_per_token >> 10} KiB a token) does not fit --kv-cache-memory-mb "
                         f"{args.kv_cache_memory_mb}")
    return EmulationConfig(args.emulate, args.time_scale)


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The flags of add_scheduler_arguments as a SchedulerConfig; ValueError on a value it refuses."""
    return SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, not args.no_chunked_prefill,
                           args.prefill_join_tokens, args.long_prefill_token_threshold)


def _check_device(name: str) -> None:
    """Fail before any process starts when --device names a GPU this machine lacks (cpu: no torch import)."""
    if name == "cpu":
        return
    from kvpush.engine.device import resolve_device
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
    g.add_argument("--host", default=_default(ServerConfig, "host"), help="address the HTTP API binds to")
    g.add_argument("--port", type=int, default=_default(ServerConfig, "port"), help="port of the HTTP API")
    g.add_argument("--role", default=_default(ServerConfig, "role").value, choices=[r.value for r in Role],
                   help="colocated (prefill and decode), prefill (P) or decode (D)")
    g.add_argument("--api-key", default=None, help="clients must send this Bearer token (default: none asked)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name the API answers to (default: the MODEL path as given)")
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
    from kvpush.launcher.placement import PlacementError, parse_cpus

    try:
        return parse_cpus(text)
    except PlacementError as e:
        raise SystemExit(f"kvpush: --cpus: {e}") from e


def add_transfer_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV transfer (prefill and decode roles)")
    g.add_argument("--kv-mode", default=_default(TransferConfig, "kv_mode").value, choices=[m.value for m in KVMode],
                   help="how KV moves from P to D; the same on every instance and the proxy")
    g.add_argument("--kv-host", default=_default(TransferConfig, "kv_host"),
                   help="address the KV side channel (handshakes) binds to")
    g.add_argument("--kv-advertise-host", default=None,
                   help="address peers should connect to (default: --kv-host, or this host's name for 0.0.0.0)")
    g.add_argument("--kv-port", type=int, default=_default(TransferConfig, "kv_port"), help="0: a free port")
    g.add_argument("--kv-secret", default=None, help="shared secret authenticating handshakes (HMAC)")
    g.add_argument("--kv-lease-s", type=float, default=_default(TransferConfig, "kv_lease_s"),
                   help="prefill: how long P holds a finished prefill's blocks for D at most")
    g.add_argument("--kv-timeout-s", type=float, default=_default(TransferConfig, "kv_timeout_s"),
                   help="decode: how long D waits for a request's KV before --on-kv-failure")
    g.add_argument("--kv-quarantine-s", type=float, default=_default(TransferConfig, "kv_quarantine_s"),
                   help="decode: a failed transfer's blocks stay unused this long unless P confirms nothing is in flight")
    g.add_argument("--kv-tombstone-s", type=float, default=_default(TransferConfig, "kv_tombstone_s"),
                   help="how long a finished transfer's record is kept, so a late message about it is known as stale")
    g.add_argument("--kv-writes-per-peer", type=int, default=_default(TransferConfig, "kv_writes_per_peer"),
                   help="prefill: whole-request WRITEs in flight to one decode instance at a time, the rest "
                        "queued in order (0: no limit)")
    g.add_argument("--on-kv-failure", default=_default(TransferConfig, "on_kv_failure").value,
                   choices=[m.value for m in OnKVFailure],
                   help="decode: when the KV does not arrive, recompute the prompt here or fail the request")
    g.add_argument("--fault-inject", action="append", default=[], metavar="NAME[:VALUE]",
                   help=f"testing only, repeatable: {', '.join(Faults.NAMES)}")


def transfer_config_from_args(args: argparse.Namespace) -> TransferConfig:
    faults = _faults(args.fault_inject)
    try:
        return TransferConfig(kv_mode=KVMode(args.kv_mode), kv_port=args.kv_port, kv_host=args.kv_host,
                              kv_advertise_host=args.kv_advertise_host, kv_quarantine_s=args.kv_quarantine_s,
                              kv_tombstone_s=args.kv_tombstone_s,
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


def add_proxy_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("proxy")
    g.add_argument("--host", default=_default(ProxyConfig, "host"), help="address the proxy binds to")
    g.add_argument("--port", type=int, default=_default(ProxyConfig, "port"), help="port of the proxy")
    _add_routing_arguments(g)
    g.add_argument("--api-key", default=None, help="clients must send this Bearer token (default: none asked)")
    g.add_argument("--instance-api-key", default=None,
                   help="the Bearer token the instances expect (default: none sent)")
    g.add_argument("--probe-interval-s", type=positive_float, default=_default(ProxyConfig, "probe_interval_s"),
                   help="how often the proxy asks every instance for /v1/kv_info (health, draining, restarts)")
    g.add_argument("--probe-timeout-s", type=positive_float, default=_default(ProxyConfig, "probe_timeout_s"),
                   help="a probe not answered within this many seconds is a miss")
    g.add_argument("--probe-misses", type=positive_int, default=_default(ProxyConfig, "probe_misses"),
                   help="an instance is skipped after this many missed probes in a row (a refused connection or a "
                        "wrong answer: at once)")
    add_auto_arguments(p)


def _add_routing_arguments(g: argparse._ArgumentGroup) -> None:
    """The flags `kvpush proxy` and `kvpush up` share."""
    g.add_argument("--kv-mode", default=_default(ProxyConfig, "kv_mode").value, choices=[m.value for m in KVMode],
                   help="how KV moves from P to D (auto: chosen per request); the same on every instance")
    g.add_argument("--first-token", default=_default(ProxyConfig, "first_token").value,
                   choices=[m.value for m in FirstToken],
                   help="D recomputes the last prompt position, or uses the token P sampled (a vLLM decode "
                        "instance always recomputes; with from-prefill the proxy streams P's token to the "
                        "client first for greedy streamed requests, checked against D's; recompute turns "
                        "both off)")
    g.add_argument("--policy", default=_default(ProxyConfig, "policy"), choices=["round-robin", "least-loaded"],
                   help="how the proxy picks a P and a D among healthy instances")


AUTO_FLAGS = ("auto_stall_weight", "auto_local_max_ms", "auto_local_share", "auto_local_window_s", "auto_near_tie",
             "auto_residual_alpha", "auto_switch_margin", "auto_busy_period")


def add_auto_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy's --kv-mode auto flags (`kvpush proxy`, and `kvpush up`, which hands them to its proxy)."""
    p = parser.add_argument_group("--kv-mode auto (the proxy's cost model; docs/protocol.md, \"Auto\")")
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


def up_parser() -> argparse.ArgumentParser:
    # no abbreviations: every flag up does not know goes to `kvpush serve`, and `--emulate` (serve's) would
    # otherwise be taken for up's `--emulated-link`
    p = argparse.ArgumentParser(prog="kvpush up", formatter_class=HelpFormatter, allow_abbrev=False,
                                description="start a local xPyD deployment plus proxy; other flags are passed to "
                                            "every `kvpush serve`")
    p.add_argument("model", help="checkpoint directory (Hugging Face format)")
    g = p.add_argument_group("deployment")
    g.add_argument("--prefill", type=int, default=1, help="prefill instances")
    g.add_argument("--decode", type=int, default=1, help="decode instances")
    g.add_argument("--port", type=int, default=_default(ProxyConfig, "port"), help="port of the front door")
    _add_routing_arguments(g)
    g.add_argument("--router", default="kvpush", choices=["kvpush", "vllm-router"],
                   help="front door: kvpush's proxy, or vllm-router (pip install vllm-router; push: sequential)")
    g.add_argument("--link-gbps", type=float, default=None, metavar="G",
                   help="root only: run P and D in two network namespaces joined by a link of G Gbit/s each way "
                        "(default: no link, one namespace)")
    g.add_argument("--emulated-link", default="profile", choices=["profile", "off"],
                   help="with --emulate: join P and D by the profile's link in emulated time (its per-rank "
                        "bandwidth divided by --time-scale each way, or --link-gbps; its latency times --time-scale "
                        "one way; root: network namespaces and tc), or off (KV moves at this host's own speed) "
                        "(default: profile)")
    g.add_argument("--pin", action="store_true",
                   help="prefill instances on one half of the cores, decode instances on the other "
                        "(proxy unpinned; default: unpinned)")
    add_auto_arguments(p)
    return p


class HelpFormatter(argparse.HelpFormatter):
    """--help states every flag's default: appended as "(default: X)" where the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.const is True and action.default is False:  # a switch
            return f"{text} (default: off)"
        if action.default is None or action.default == [] or action.default == {}:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"
