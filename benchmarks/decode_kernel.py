"""The C decode-attention kernel (layers/paged_decode.c) against its version at another git revision.

    python benchmarks/decode_kernel.py --against REV [--repeats 40] [--heads 6,3,64]

Builds the kernel's source at REV (`git show REV:kvpush/layers/paged_decode.c`, and its cpu_vec.h) with the same flags
as layers/cpu_kernels.py, loads both, checks they agree, then times one call of each per repeat,
alternating, for a few batch shapes of the bench preset's attention (6 query heads over 3 KV heads
of 64, block 16, 8 layers, the KV cache on huge pages, block tables shuffled; `--heads H,KVH,D` for
other heads, e.g. 32,4,128 as Llama-3-8B's). Before every call a
64 MiB buffer is written, so the rows come from beyond L2, as in a real step after the weights
went through. Prints per shape the medians and current / REV with a 95% bootstrap interval (paired).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvpush.argtypes import positive_int
from kvpush.bench.machine import machine_line
from kvpush.bench.stats import fmt_ci, p50, ratio_ci, verdict
from kvpush.config import c_compiler
from kvpush.engine.kv_cache import allocate_kv
from kvpush.layers import cpu_kernels

SHAPES = ((1, 100), (16, 96), (16, 500), (64, 200))  # (sequences, context tokens)
LAYERS, BLOCK, KV_HEADS, HEAD, HEADS = 8, 16, 3, 64, 6


def build_at(rev: str, workdir: Path) -> cpu_kernels.PagedDecode:
    source = workdir / "paged_decode.c"
    for name in ("paged_decode.c", "cpu_vec.h"):  # the header from 3024a3e on; before, none was included
        shown = subprocess.run(["git", "show", f"{rev}:kvpush/layers/{name}"], capture_output=True, text=True)
        if shown.returncode == 0:
            (workdir / name).write_text(shown.stdout)
    obj, lib = workdir / "kernel.o", workdir / "kernel.so"
    subprocess.run([c_compiler(), *cpu_kernels.FLAGS, "-c", str(source), "-o", str(obj)], check=True)
    subprocess.run([c_compiler(), str(obj), "-o", str(lib), *cpu_kernels.LINK], check=True)
    return cpu_kernels.PagedDecode(ctypes.CDLL(str(lib)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="git revision whose kernel to compare with")
    ap.add_argument("--repeats", type=positive_int, default=40, help="calls of each kernel per shape (default: 40)")
    ap.add_argument("--heads", default=f"{HEADS},{KV_HEADS},{HEAD}",
                    help="query heads, KV heads, head size (default: %(default)s, the bench preset's)")
    args = ap.parse_args()
    heads, kv_heads, head = (int(x) for x in args.heads.split(","))
    torch.set_num_threads(1)
    current = cpu_kernels.paged_decode_kernel()
    if current is None:
        raise SystemExit("the current kernel cannot be built here (see the log line above)")
    junk = torch.empty(16 << 20)  # 64 MiB
    print(f"{machine_line()}\n{heads} query heads over {kv_heads} KV heads of {head}")
    print(f"| sequences x context | current us | {args.against} us | current / {args.against} [95% CI] | verdict |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        other = build_at(args.against, Path(tmp))
        gen = torch.Generator().manual_seed(0)
        for b, ctx in SHAPES:
            nb = -(-ctx // BLOCK)
            block_bytes = LAYERS * 2 * BLOCK * kv_heads * head * 4
            n = max(min(2048, (1 << 30) // block_bytes), b * nb + 1)  # at most 1 GiB where the rows fit
            kv = allocate_kv((n, LAYERS, 2, BLOCK, kv_heads, head), torch.float32, "cpu")
            kv.normal_(generator=gen)
            table = torch.randperm(n, generator=gen)[: b * nb].view(b, nb).contiguous()
            lens = torch.randint(max(1, ctx - 30), ctx + 1, (b,), generator=gen)
            q = torch.randn(b, heads, head, generator=gen)
            torch.testing.assert_close(current(q, kv, table, lens, 1, 0.125), other(q, kv, table, lens, 1, 0.125),
                                       rtol=1e-5, atol=1e-5)
            times: dict[str, list[float]] = {"current": [], "other": []}
            for i in range(args.repeats):
                pair = [("current", current), ("other", other)]
                for name, kernel in pair if i % 2 == 0 else pair[::-1]:
                    junk.add_(1.0)
                    t = time.perf_counter()
                    kernel(q, kv, table, lens, i % LAYERS, 0.125)
                    times[name].append(time.perf_counter() - t)
            est, lo, hi = ratio_ci(times["current"], times["other"], stat=p50, paired=True)
            print(f"| {b} x {ctx} | {statistics.median(times['current']) * 1e6:.0f} | "
                  f"{statistics.median(times['other']) * 1e6:.0f} | {fmt_ci(est, lo, hi)} | "
                  f"{verdict(lo, hi, 'current', args.against)} |")
            del kv


if __name__ == "__main__":
    main()
