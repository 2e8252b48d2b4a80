"""torch.compile of the model's layers with inductor, and the warm-up that compiles them up front.

`decoder_layers` (models/decoder.py: embedding and every layer) compiles into one graph with the
token count as a symbolic size (dim 0 of input_ids and positions), so the same graph serves every
batch of two or more tokens; a one-token batch (one decoding sequence) gets its own graph, as
dynamo specialises sizes 0 and 1. Paged attention is one opaque op inside the graph (its own
kernels - the CPU decode kernel, SDPA - beat inductor-generated attention here). One graph per
forward, not one per layer piece: the guard check and the graph call cost ~0.3 ms per call on
one core, which 16 piece calls a step made larger than the fusion gained for decode batches.
The warm-up runs a two-token and a one-token batch, so a running server does not compile again:
`num_graphs` counts graphs compiled in this process (an engine stat and a metric).

A compiler is never a hard requirement: in `auto` mode a failure to build (no C++ compiler, an
inductor error) leaves the model eager with one log line; in `on` mode it raises CompileError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvpush.config import CompileMode, apply_compile_environment
from kvpush.errors import CompileError
from kvpush.models.decoder import CausalLM, decoder_layers

log = logging.getLogger(__name__)

WARM_UP_TOKENS = (2, 1)  # one forward per graph: the symbolic token count, and the one-token batch
RECOMPILE_LIMIT = 64  # graphs of decoder_layers; engines in one process (tests) each add a few
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
    """fn(model, input_ids, positions) compiled with the token count (dim 0 of both tensors)
    symbolic and every other size, weights' included, static."""
    compiled = torch.compile(fn, backend=_counting_inductor, dynamic=None)

    def run(model, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        return compiled(model, input_ids, positions)

    return run


def compile_model(model: CausalLM, mode: CompileMode, warm_up: Callable[[int], None]) -> bool:
    """Give the model compiled layers and compile them by running `warm_up(tokens)` for each of
    WARM_UP_TOKENS.

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
    model.compiled_layers = _compile(decoder_layers)
    try:
        for tokens in WARM_UP_TOKENS:
            warm_up(tokens)
    except (torch._dynamo.exc.TorchDynamoException, RuntimeError, OSError) as e:
        model.compiled_layers = None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if mode is CompileMode.ON:
            raise CompileError(f"--compile on, but the model cannot be compiled here: {reason}") from e
        log.warning("torch.compile is unavailable here (%s); serving eagerly", reason)
        return False
    return True
