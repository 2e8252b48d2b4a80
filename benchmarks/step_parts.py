"""Where a decode step's time goes: the engine's own parts timed inside real steps, one torch thread.

    python benchmarks/step_parts.py [--batches 1 16] [--steps 32] [--repeats 3] [--compile on]

For each batch size, `batch` sequences of 64 prompt tokens (engine_throughput.py's decode workload)
decode `--steps` steps together; timers wrap the parts of each step (monkeypatched for this process
only): building the inputs (ModelRunner.prepare), the model's forward (CausalLM.forward), inside it
the attention op (layers/attention.paged_attention, all layers) and within that the C decode kernel
and the K/V writes into the cache, then sampling. "other" is the step minus prepare, forward and
sampling (the scheduler, the block manager, output bookkeeping); "graph rest" is the forward minus the
attention op: the linears, norms, rotary, activations and the compiled graph's own calls, and since
5e7d91a also the final norm, LM head and greedy tokens (before, the LM head ran eagerly after the graph and
"sample" took the greedy tokens' max: parts from either side of that commit do not compare). Also times
"linears alone" (engine_throughput.py) right after each repeat. Prints medians over the repeats, ms a
step. Timers cost a few microseconds a call; compare parts within one run, not across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from engine_ab import build  # run as a script: benchmarks/ is on sys.path
from engine_throughput import linears_alone, prompt

from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import machine_line
from kvpush.config import default_model_dir
from kvpush.engine import kv_cache, model_runner
from kvpush.engine.sampling_params import SamplingParams
from kvpush.layers import attention, cpu_kernels
from kvpush.models import decoder

PARTS = ("prepare", "forward", "attention op", "decode kernel", "KV writes", "sample")
_spent: dict[str, float] = {}


def timed(owner: object, name: str, part: str) -> None:
    """Replace owner.name by a timer around it that adds its seconds to _spent[part]."""
    inner: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _spent[part] = _spent.get(part, 0.0) + time.perf_counter() - t

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed(model_runner.ModelRunner, "prepare", "prepare")
    timed(decoder.CausalLM, "forward", "forward")
    timed(attention, "paged_attention", "attention op")
    timed(cpu_kernels.PagedDecode, "__call__", "decode kernel")
    timed(kv_cache.KVCache, "write", "KV writes")
    timed(model_runner, "sample", "sample")


def one_repeat(eng, batch: int, steps: int, seed: int) -> dict[str, float]:
    """ms a step per part, over `steps` steps in which every one of `batch` sequences decodes."""
    params = SamplingParams(max_tokens=steps + batch + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"p{seed}-{batch}-{i}", prompt(64, seed * 100 + i, eng.arch.vocab_size), params)
    decoding: set[str] = set()
    while len(decoding) < batch:  # the prefills, untimed
        decoding |= {o.request_id for o in eng.step() if o.new_token_ids}
    _spent.clear()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step = time.perf_counter() - t
    out = {part: _spent.get(part, 0.0) * 1e3 / steps for part in PARTS}
    while eng.has_unfinished():  # the rest, untimed
        eng.step()
    out["step"] = step * 1e3 / steps
    out["other"] = out["step"] - out["prepare"] - out["forward"] - out["sample"]
    out["graph rest"] = out["forward"] - out["attention op"]
    out["linears alone"] = batch * 1e3 / linears_alone(eng, batch, steps, seed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="decode batch sizes (default: 1 16)")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per repeat (default: 32)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per batch size (default: 3)")
    ap.add_argument("--compile", default="on", choices=("on", "off", "auto"), help="engine compile mode (default: on)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = args.model or ensure_model(default_model_dir(), "bench")
    eng = build(model, {"compile": args.compile})
    instrument()
    rows = ("step", "prepare", "forward", "attention op", "decode kernel", "KV writes", "graph rest", "sample",
            "other", "linears alone")
    results = {b: [one_repeat(eng, b, args.steps, r) for r in range(args.repeats)] for b in args.batches}
    print(f"\n{machine_line()}\n{model}, compile {args.compile}, {eng.linear_choice.line()}\n")
    print("| ms a step (median of repeats) | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---" * (1 + len(args.batches)) + "|")
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{statistics.median(r[row] for r in results[b]):.2f}"
                                         for b in args.batches) + " |")


if __name__ == "__main__":
    main()
