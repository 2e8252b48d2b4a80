"""A/B of two engine variants on the same checkpoint, in one process, alternating: is a change faster?

    python benchmarks/engine_ab.py --a huge_pages=off --b huge_pages=on [--repeats 9]
                                   [--workloads decode1 decode16 prefill512] [--model DIR]
    python benchmarks/engine_ab.py --a linear=mkl --b linear=onednn     # the two linear backends
    python benchmarks/engine_ab.py --a attention=kernel --b attention=sdpa   # the two decode attentions
    python benchmarks/engine_ab.py --a prefill=sdpa --b prefill=kernel --workloads prefill512 prefill2048

Builds one LLMEngine per variant (settings: `compile=on|off|auto`, `huge_pages=on|off`,
`trim=on|off`: the heap trimmed before each timed workload, `linear=auto|mkl|onednn`: the
linear layers' backend, --linear-backend; default auto, what this machine's calibration chose;
`attention=auto|kernel|sdpa`: decode attention, --decode-attention (default auto, likewise);
`prefill=auto|kernel|sdpa`: prefill attention, --prefill-attention (default auto, likewise);
`wrapper=cpp|python`: the compiled graph's wrapper, inductor's C++ one (kvpush's default on CPU) or
Python; each compiled variant gets a graph of its own, engine/compiler.py's separate_graphs), then per
repeat runs every workload on both engines, the order alternating between repeats, so that the
machine's drift (+-15% here from one minute to the next) hits both alike. Workloads: `decodeN`
(N sequences of 64 prompt tokens decode 32 steps together; ms per step), `prefillN` (one N-token
prompt; ms). Prints per workload the median of each variant and B/A with a 95% bootstrap interval
over the repeats (paired: repeat k of A with repeat k of B) and a verdict ("cannot tell" when the
interval spans 1). One torch thread, the bench preset by default (made if missing).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from engine_throughput import kv_decode, kv_prefill  # run as a script: benchmarks/ is on sys.path

from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import machine_line
from kvpush.bench.stats import fmt_ci, p50, ratio_ci, verdict
from kvpush.config import (
    CacheConfig,
    CompileMode,
    DecodeAttention,
    EngineConfig,
    LinearBackend,
    ModelConfig,
    SchedulerConfig,
    default_model_dir,
)
from kvpush.engine.compiler import separate_graphs
from kvpush.engine.engine import LLMEngine
from kvpush.engine.native_memory import trim_heap

# trim=on: malloc_trim right before each timed workload of that variant, as the engine core does when idle
SETTINGS = {"compile": ("on", "off", "auto"), "huge_pages": ("on", "off"), "trim": ("on", "off"),
            "linear": ("auto", "mkl", "onednn"), "attention": ("auto", "kernel", "sdpa"),
            "prefill": ("auto", "kernel", "sdpa"), "wrapper": ("cpp", "python")}
DECODE_STEPS = 32


def variant(text: str) -> dict[str, str]:
    """`key=value[,key=value]` -> settings; argparse error on an unknown key or value."""
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if value not in SETTINGS.get(key, ()):
            raise argparse.ArgumentTypeError(f"{part!r}: expected one of " + ", ".join(
                f"{k}={'|'.join(v)}" for k, v in SETTINGS.items()))
        out[key] = value
    return out


def build(model: str, settings: dict[str, str]) -> LLMEngine:
    with separate_graphs(cpp_wrapper=settings.get("wrapper", "cpp") == "cpp"):
        return LLMEngine(EngineConfig(
            ModelConfig(model, huge_pages=settings.get("huge_pages", "on") == "on"),
            CacheConfig(num_blocks=2048, enable_prefix_caching=False),
            SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
            compile=CompileMode(settings.get("compile", "auto")),
            linear_backend=LinearBackend(settings.get("linear", "auto")),
            decode_attention=DecodeAttention(settings.get("attention", "auto")),
            prefill_attention=DecodeAttention(settings.get("prefill", "auto"))))


def parse_workload(name: str) -> tuple[str, int] | None:
    """`decodeN` / `prefillN` -> (kind, N); None if it is neither (or N < 1)."""
    kind = name.rstrip("0123456789")
    if kind not in ("decode", "prefill") or kind == name or int(name[len(kind):]) < 1:
        return None
    return kind, int(name[len(kind):])


def run_workload(eng: LLMEngine, name: str, seed: int) -> float:
    """ms per decode step (decodeN) or per prefill (prefillN), with engine_throughput.py's workloads."""
    kind, n = parse_workload(name) or ("", 0)
    if kind == "prefill":
        return n * 1e3 / kv_prefill(eng, n, seed)
    return n * 1e3 / kv_decode(eng, n, DECODE_STEPS, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=variant, required=True, help="variant A, e.g. huge_pages=off")
    ap.add_argument("--b", type=variant, required=True, help="variant B, e.g. huge_pages=on")
    ap.add_argument("--workloads", nargs="+", default=["decode1", "decode16", "prefill512"])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    args = ap.parse_args()
    for w in args.workloads:
        if parse_workload(w) is None:
            ap.error(f"workload {w!r}: expected decodeN or prefillN (N >= 1)")
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (an interval needs a few)")
    torch.set_num_threads(1)
    model = args.model or ensure_model(default_model_dir(), "bench")
    engines = {"A": build(model, args.a), "B": build(model, args.b)}
    times: dict[tuple[str, str], list[float]] = {(v, w): [] for v in engines for w in args.workloads}
    for rep in range(args.repeats):
        order = ["A", "B"] if rep % 2 == 0 else ["B", "A"]
        for w in args.workloads:
            for v in order:
                if (args.a if v == "A" else args.b).get("trim") == "on":
                    trim_heap()
                times[(v, w)].append(run_workload(engines[v], w, rep))
    print(f"\n{machine_line()}")
    print(f"A = {args.a or 'defaults'}, B = {args.b or 'defaults'}; {model}, one torch thread, "
          f"{args.repeats} repeats alternating")
    for v, eng in engines.items():
        print(f"{v}: compiled {eng.runner.compiled}; {eng.linear_choice.line()}; {eng.attention_choice.line()}")
    print()
    print("| workload | A ms (median) | B ms (median) | B/A [95% CI] | verdict |")
    print("|---|---|---|---|---|")
    for w in args.workloads:
        a, b = times[("A", w)], times[("B", w)]
        est, lo, hi = ratio_ci(b, a, stat=p50, paired=True)
        print(f"| {w} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | {fmt_ci(est, lo, hi)} | "
              f"{verdict(lo, hi, 'B', 'A')} |")


if __name__ == "__main__":
    main()
