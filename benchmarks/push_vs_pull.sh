#!/usr/bin/env bash
# The long push vs pull comparison: 200 requests per mode and rate, P and D pinned (about 60-90 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
make install
.venv/bin/python benchmarks/push_vs_pull.py --rates 0.5 1 2 4 --num-prompts 50 --repeats 4 "$@"
