"""kvpush: push-based KV-cache transfer for disaggregated LLM inference.

`import kvpush` loads nothing else: `LLM` and `SamplingParams` are imported on first use, so that the
CLI, the proxy and the benchmarks never load the engine they do not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.engine.llm import LLM
    from kvpush.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kvpush.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvpush.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
