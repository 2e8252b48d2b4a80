"""The engine-core process's entry point, light enough for the API process to import (the spawned
child imports the engine, torch and the model; the API process never does)."""

from __future__ import annotations


def run_engine_core(*args: object) -> None:
    from kvpush.instance.engine_core import run_engine_core as run

    run(*args)  # type: ignore[arg-type]
