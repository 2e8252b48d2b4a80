"""kvpush: push-based KV-cache transfer for disaggregated LLM inference."""

from kvpush.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: `import kvpush` stays cheap for the CLI and the proxy
        from kvpush.llm import LLM

        return LLM
    raise AttributeError(name)
