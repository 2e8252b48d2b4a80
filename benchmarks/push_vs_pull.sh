#!/usr/bin/env bash
# The longer push vs pull comparison behind the README's table (about 15-20 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
make install
.venv/bin/python benchmarks/push_vs_pull.py --rates 0.5 1 2 4 --num-prompts 40 --repeats 3 "$@"
