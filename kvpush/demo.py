"""`kvpush demo`, the README's main job.

Until the disaggregated demo lands: make the tiny model if missing, start a colocated server on a
free loopback port, stream one completion to the terminal, stop the server.
"""

from __future__ import annotations

import argparse
import os

from kvpush.config import default_model_dir
from kvpush.launch import ServerProcess, free_port


def ensure_model(model_dir: str, preset: str) -> str:
    path = os.path.join(model_dir, preset)
    if not os.path.isfile(os.path.join(path, "config.json")):
        from kvpush.models.make_model import make_model

        print(f"kvpush demo: creating the {preset} model in {path}")
        make_model(path, preset=preset, seed=0)
    return path


def run_demo(args: argparse.Namespace) -> int:
    model = ensure_model(args.model_dir or default_model_dir(), "tiny")
    port = args.port or free_port()
    with ServerProcess(["serve", model, "--port", str(port), "--served-model-name", "tiny"]) as server:
        server.wait_healthy(timeout_s=120)
        print(f"kvpush demo: colocated server up at {server.url}; streaming one completion:\n")
        for text in server.stream_completion("tiny", "The quick brown fox", max_tokens=32):
            print(text, end="", flush=True)
        print("\n\nkvpush demo: done")
    return 0
