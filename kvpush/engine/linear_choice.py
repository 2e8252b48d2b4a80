"""Which backend the model's linear layers use on this machine (`--linear-backend`, layers/linear.py).

`auto` (the default) times both backends at start-up on the model's own linear shapes, with random
weights: a decode step's linears at 1 and 16 rows (the LM head over the same rows) and a prefill's at
512 (the LM head over one row), each backend alternately, medians. oneDNN is chosen when the geometric
mean of its time over MKL's across the three is below 1 - MARGIN; otherwise, ties included, MKL (the
path with no packing). The MKL side's weights sit on huge pages when the model's will; the oneDNN
side runs through `kvpush::onednn_linear` when the model compiles, as a compiled forward calls it.

The choice is cached in a JSON file (config.linear_cache_dir(), one file per key) keyed by the CPU
(model name, family/model/stepping, vector extensions), torch's version, the torch threads, the dtype,
the linear shapes, the workloads and how the packed side is called. A start with the same key reads
it instead of measuring; any other key measures again. A checkpoint path is recorded, not keyed: two
checkpoints of one architecture share the choice. The engine logs the choice in one line.

Calibration copies at most CALIBRATION_BYTES of the layers' weights (twice: plain and packed): for a
larger model it times the first layers up to that size. It times the LM head too, which is packed only
up to layers/linear.py's HEAD_MAX_BYTES.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvpush.config import CompileMode, EngineConfig, LinearBackend, linear_cache_dir
from kvpush.engine import calibration as cal
from kvpush.engine.calibration import cpu_identity
from kvpush.errors import DeviceError, ModelLoadError
from kvpush.layers import linear as L

FORMAT = 1  # of the cache file; a new one invalidates old files
MARGIN = 0.03  # oneDNN must be this much faster (geometric mean) to be chosen: noise keeps MKL
CALIBRATION_BYTES = 128 << 20  # weights copied for timing: enough to stream past a CPU's caches


@dataclass(frozen=True)
class Workload:
    name: str
    rows: int  # rows through every layer's linears
    logit_rows: int  # rows through the LM head


WORKLOADS = (Workload("decode 1", 1, 1), Workload("decode 16", 16, 16), Workload("prefill 512", 512, 1))


@dataclass(frozen=True)
class Shape:
    in_features: int
    out_features: int
    bias: bool
    logits: bool  # the LM head: applied to the sampled rows only

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.in_features * self.out_features * dtype.itemsize


Timings = dict[str, tuple[float, float]]  # workload -> (mkl ms, onednn ms), medians
Measure = Callable[[Sequence[Shape], torch.dtype, bool, bool], Timings]


@dataclass
class Choice:
    backend: LinearBackend  # MKL or ONEDNN
    source: str  # flag | measured | cached | device (not a CPU) | unavailable (oneDNN cannot run here)
    timings: Timings = field(default_factory=dict)
    path: str | None = None
    seconds: float = 0.0  # what measuring took
    when: str = ""  # when the timings were measured
    note: str = ""

    def line(self) -> str:
        """The start-up log line."""
        head = f"linear backend: {self.backend.value}"
        if self.source == "flag":
            return f"{head} (forced by --linear-backend)"
        if self.source in ("device", "unavailable"):
            return f"{head} ({self.note})"
        return f"{head} " + cal.measured_line(self.source, self.seconds, self.when, self.path, self.timings,
                                              ("mkl", "onednn"), 2)


def ratio(timings: Timings) -> float:
    """Geometric mean over the workloads of oneDNN's time over MKL's."""
    return cal.ratio(timings)


def decide(timings: Timings) -> LinearBackend:
    return LinearBackend.ONEDNN if ratio(timings) < 1 - MARGIN else LinearBackend.MKL


def model_shapes(model: nn.Module) -> list[Shape]:
    """The linears the `onednn` backend would pack, in forward order (a meta-device model will do)."""
    head = getattr(model, "lm_head", None)
    return [Shape(m.in_features, m.out_features, m.bias is not None, m is head) for _, _, m in L.packable(model)]


def timed_shapes(shapes: Sequence[Shape], dtype: torch.dtype, budget: int = CALIBRATION_BYTES) -> list[Shape]:
    """What calibration times: the layers' linears in order up to `budget` bytes (at least the first), and
    the LM head (model_shapes gives it only where it is packed: up to HEAD_MAX_BYTES)."""
    out: list[Shape] = []
    used = 0
    for s in shapes:
        if not s.logits and (not out or used + s.nbytes(dtype) <= budget):
            out.append(s)
            used += s.nbytes(dtype)
    return out + [s for s in shapes if s.logits]


def cache_key(cpu: dict[str, Any], shapes: Sequence[Shape], dtype: torch.dtype, threads: int, through_op: bool,
              huge_pages: bool) -> dict[str, Any]:
    return {"format": FORMAT, "cpu": cpu_identity(cpu), "torch": str(torch.__version__), "threads": threads,
            "dtype": str(dtype).removeprefix("torch."), "through_op": through_op, "huge_pages": huge_pages,
            "shapes": [[s.in_features, s.out_features, s.bias, s.logits] for s in shapes],
            "workloads": [[w.name, w.rows, w.logit_rows] for w in WORKLOADS]}


def cache_path(cache_dir: str, key: dict[str, Any]) -> Path:
    return cal.cache_path(cache_dir, "linear", key)


def read_entry(path: Path) -> dict[str, Any] | None:
    entry = cal.read_json(path)
    ok = entry is not None and entry.get("backend") in (LinearBackend.MKL, LinearBackend.ONEDNN)
    return entry if ok else None


def cached_entries(cache_dir: str, cpu: dict[str, Any]) -> list[dict[str, Any]]:
    """Every cached choice made on this CPU model with this torch (for `kvpush env`), newest first."""
    here = {"cpu": cpu_identity(cpu), "torch": str(torch.__version__), "format": FORMAT}
    return [e for e in cal.entries(cache_dir, "linear", here) if e.get("backend") in (LinearBackend.MKL,
                                                                                      LinearBackend.ONEDNN)]


def choose(requested: LinearBackend, model: nn.Module, dtype: torch.dtype, device: torch.device, *,
           cpu: dict[str, Any], cache_dir: str, through_op: bool, huge_pages: bool, label: str = "",
           measure: Measure | None = None) -> Choice:
    """The backend for `model` (its linear shapes; a meta-device copy will do) on this machine."""
    if requested is LinearBackend.MKL:
        return Choice(LinearBackend.MKL, "flag")
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        why = f"oneDNN packing is for CPUs, the model runs on {device}" if device.type != "cpu" \
            else "torch was built without oneDNN"
        if requested is LinearBackend.ONEDNN:
            error = DeviceError if device.type != "cpu" else ModelLoadError
            raise error(f"--linear-backend onednn: {why}")
        return Choice(LinearBackend.MKL, "device" if device.type != "cpu" else "unavailable", note=why)
    if requested is LinearBackend.ONEDNN:
        return Choice(LinearBackend.ONEDNN, "flag")
    shapes = timed_shapes(model_shapes(model), dtype)
    if not shapes:
        return Choice(LinearBackend.MKL, "unavailable", note="no linear layer to pack")
    key = cache_key(cpu, shapes, dtype, torch.get_num_threads(), through_op, huge_pages)
    path = cache_path(cache_dir, key)
    if (cached := _cached(path, key)) is not None:
        return cached
    with cal.locked(path):  # instances starting together (kvpush up) measure once
        if (cached := _cached(path, key)) is not None:
            return cached
        start = time.perf_counter()
        try:
            timings = (measure or measure_backends)(shapes, dtype, through_op, huge_pages)
        except RuntimeError as e:  # oneDNN cannot pack or multiply this dtype here
            return Choice(LinearBackend.MKL, "unavailable", note=f"oneDNN failed: {str(e).strip().splitlines()[0]}")
        seconds = time.perf_counter() - start
        backend = decide(timings)
        when = cal.now()
        cal.write_entry(path, {"key": key, "backend": backend.value, "timings": timings, "ratio": ratio(timings),
                            "measured_at": when, "seconds": round(seconds, 2), "model": label})
    return Choice(backend, "measured", timings, str(path), seconds, when)


def _cached(path: Path, key: dict[str, Any]) -> Choice | None:
    entry = read_entry(path)
    if entry is None or entry.get("key") != key:
        return None
    timings = {w: (float(m), float(o)) for w, (m, o) in entry["timings"].items()}
    return Choice(LinearBackend(entry["backend"]), "cached", timings, str(path), when=entry.get("measured_at", ""))


def choose_for(config: EngineConfig, device: torch.device, cpu: dict[str, Any]) -> Choice:
    """choose() for an engine about to load `config`'s model on a CPU of bench/machine.py's cpu() facts.
    The shapes come from a meta-device copy of the model, built only where they are needed (building it
    imports torch._dynamo: call config.apply_compile_environment() first)."""
    from kvpush.models.decoder import CausalLM
    from kvpush.models.loader import load_arch_config, resolve_dtype

    arch = load_arch_config(config.model.model)
    shapes = nn.Module()
    if config.linear_backend is LinearBackend.AUTO and device.type == "cpu":
        with torch.device("meta"):
            shapes = CausalLM(arch, 1)
    return choose(config.linear_backend, shapes, resolve_dtype(config.model.dtype, arch), device, cpu=cpu,
                  cache_dir=linear_cache_dir(), through_op=config.compile is not CompileMode.OFF,
                  huge_pages=config.model.huge_pages, label=config.model.model)


def _weights(shapes: Sequence[Shape], dtype: torch.dtype, huge_pages: bool) -> list[nn.Linear]:
    """Random nn.Linears of the shapes; on one huge-page arena where the model's weights will be."""
    gen = torch.Generator().manual_seed(0)
    mods = []
    for s in shapes:
        m = nn.Linear(s.in_features, s.out_features, bias=s.bias, dtype=dtype)
        with torch.no_grad():
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * s.in_features ** -0.5)
        mods.append(m.eval())
    if huge_pages:
        from kvpush.models.loader import pack_on_huge_pages

        pack_on_huge_pages(nn.ModuleList(mods))
    return mods


def measure_backends(shapes: Sequence[Shape], dtype: torch.dtype, through_op: bool, huge_pages: bool) -> Timings:
    """Median ms of one pass over the linears, each backend, per workload (rounds alternate the order)."""
    plain = _weights(shapes, dtype, huge_pages)
    packed = [L.PackedLinear(m) for m in _weights(shapes, dtype, False)]

    def onednn(x: torch.Tensor, m: L.PackedLinear) -> torch.Tensor:
        if through_op:
            return torch.ops.kvpush.onednn_linear(x, m.bias, None, m.handle, m.out_features)
        return m(x)

    out: Timings = {}
    with torch.inference_mode():
        for w in WORKLOADS:
            xs = {(s.in_features, s.logits): torch.randn(w.logit_rows if s.logits else w.rows, s.in_features,
                                                         dtype=dtype) for s in shapes}
            ins = [xs[(s.in_features, s.logits)] for s in shapes]

            def mkl_pass(ins=ins) -> None:
                for x, m in zip(ins, plain, strict=True):
                    L.plain_linear(x, m.weight, m.bias)

            def onednn_pass(ins=ins) -> None:
                for x, m in zip(ins, packed, strict=True):
                    onednn(x, m)

            out[w.name] = cal.alternate(mkl_pass, onednn_pass)
    return out

