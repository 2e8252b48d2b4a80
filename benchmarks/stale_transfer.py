"""Stale WRITEs and READs: 200 forced-late transfers per mode, every HTTP 200 against a colocated run.

    python benchmarks/stale_transfer.py [--count 200] [--modes push pull] [--quarantine-s 0]

The scenario (kvpush/bench/stale.py): push stalls P's WRITE past D's deadline, pull stalls D's READ
past P's lease, while other requests keep the blocks busy. Target: 0 wrong 200s. `--quarantine-s 0`
is the control: D releases an expired transfer's blocks at once instead of waiting for the late
WRITE to end, and wrong answers should appear (push), which shows the check can fail.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvpush import LLM, SamplingParams
from kvpush.bench.demo import ensure_model
from kvpush.bench.stale import BS, run_stale
from kvpush.config import default_model_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the tiny preset under $KVPUSH_MODEL_DIR")
    ap.add_argument("--count", type=int, default=200, help="forced-late transfers per mode")
    ap.add_argument("--modes", nargs="+", default=["push", "pull"], choices=["push", "pull"])
    ap.add_argument("--quarantine-s", type=float, default=None, help="D's --kv-quarantine-s (control: 0)")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "tiny")
    llm = LLM(model, block_size=BS, num_blocks=512)
    cache: dict[tuple[int, ...], str] = {}

    def colocated(prompt: list[int], max_tokens: int) -> str:
        key = (*prompt, -max_tokens)
        if key not in cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            cache[key] = llm.generate([prompt], params)[0].text
        return cache[key]

    failed = False
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix=f"kvpush-stale-{mode}-") as logs:
            result = run_stale(model, mode, args.count, Path(logs), colocated, args.quarantine_s)
        print(result.summary(), flush=True)
        for line in (result.wrong + result.errors)[:10]:
            print("  ", line)
        failed |= bool(result.wrong or result.errors or result.leftovers) or result.forced_late < args.count
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
