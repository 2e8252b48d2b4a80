"""torch.compile of the model's pieces with inductor, and the warm-up that compiles them up front.

The compiled pieces (`attention_input`, `attention_output`, see models/decoder.py) have the token
count as a symbolic size (dim 0 of their tensor arguments), so one graph per piece serves every batch of at least
COMPILED_MIN_TOKENS tokens. Paged attention stays eager between them (its gather + SDPA beat an
inductor-generated decode kernel here). The warm-up runs one such batch, so a running server does
not compile again: `num_graphs` counts graphs compiled in this process (an engine stat and a metric).

A compiler is never a hard requirement: in `auto` mode a failure to build (no C++ compiler, an
inductor error) leaves the model eager with one log line; in `on` mode it raises CompileError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvpush.config import CompileMode, apply_compile_environment
from kvpush.errors import CompileError
from kvpush.models.decoder import CausalLM, Pieces, attention_input, attention_output

log = logging.getLogger(__name__)

# Batches of fewer tokens (decode steps, short prefills) run eagerly: on one CPU core the fused
# elementwise kernels gain less there than torch.compile's per-call guard and dispatch cost (about
# 0.1 ms per piece call, 16 calls a step); from a few hundred tokens on, prefill runs 5-15% faster.
COMPILED_MIN_TOKENS = 128
RECOMPILE_LIMIT = 64  # graphs per piece; engines in one process (tests) each add a few shape classes
_num_graphs = 0


def num_graphs() -> int:
    """Graphs compiled in this process so far."""
    return _num_graphs


def _counting_inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    global _num_graphs
    _num_graphs += 1
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)  # type: ignore[return-value]


def _compile(fn: Callable) -> Callable:
    """fn(layer, *tensors) compiled with the token count (dim 0 of every tensor) symbolic and every
    other size, weights' included, static."""
    compiled = torch.compile(fn, backend=_counting_inductor, dynamic=None)

    def run(layer, *tensors: torch.Tensor):
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(layer, *tensors)

    return run


def compile_model(model: CausalLM, mode: CompileMode, warm_up: Callable[[], None]) -> bool:
    """Swap the model's pieces for compiled ones and compile them by running `warm_up`.

    Returns True if the model now runs compiled. Raises CompileError only in `on` mode.
    """
    if mode is CompileMode.OFF:
        return False
    apply_compile_environment()
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # compile in this process, on the one core it has
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    # Without this the warm-up's token count would be unified with any weight dimension of the same
    # size (duck shaping) and the graph specialised to it: every other count would recompile.
    torch.fx.experimental._config.use_duck_shape = False
    model.compiled_pieces = Pieces(_compile(attention_input), _compile(attention_output))
    model.compiled_min_tokens = COMPILED_MIN_TOKENS
    try:
        warm_up()
    except (torch._dynamo.exc.TorchDynamoException, RuntimeError, OSError) as e:
        model.compiled_pieces = None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if mode is CompileMode.ON:
            raise CompileError(f"--compile on, but the model cannot be compiled here: {reason}") from e
        log.warning("torch.compile is unavailable here (%s); serving eagerly", reason)
        return False
    return True
