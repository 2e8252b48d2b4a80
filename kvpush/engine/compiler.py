"""torch.compile of the model's forward with inductor, and the warm-up that compiles it up front.

`decoder_logits` (models/decoder.py: embedding, every layer, the sampled rows' final norm, LM head and
greedy tokens) compiles into one graph with the token count (dim 0 of input_ids and positions) and
the sampled rows' count (dim 0 of logit_rows) as symbolic sizes, so the same graph serves every
batch. The sizes are *unbacked* (mark_unbacked): dynamo would otherwise specialise sizes 0 and 1 and
compile a second graph for the one-token batch (one decoding sequence), which cost ~7 s of a cold
start (of ~31 s, 2026-12-07) and measured no faster (benchmarks/engine_ab.py-style A/B, decode 1:
0.95 [0.94, 1.02], cannot tell). The inputs must each own their storage (a view's storage offset
would be guarded, and specialised). Paged attention is one opaque op inside the graph (its own
kernels - the CPU decode kernel, SDPA - beat inductor-generated attention here). One graph per
forward, not one per layer piece: the guard check and the graph call cost ~0.3 ms per call on
one core, which 16 piece calls a step made larger than the fusion gained for decode batches.
On CPU the graph's wrapper (the code that calls its kernels, the linears' GEMMs and the attention
op in turn) is C++ (inductor's cpp_wrapper), not Python: ~100 calls a forward at ~10 us of Python
each were ~15% of a batch-16 decode step (2026-12-07, Intel fam 6 model 167: 12.8 vs 15.2 ms a
step, batch 1 4.5 vs 4.8; a cold compile ~1 s longer, 24.5 vs 23.5 s).
The warm-up runs one two-token batch, so a running server does not compile again:
`num_graphs` counts graphs compiled in this process (an engine stat and a metric).

A compiler is never a hard requirement: in `auto` mode a failure to build (no C++ compiler, an
inductor error) leaves the model eager with one log line; in `on` mode it raises CompileError.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator

import torch

from kvpush.config import CompileMode, apply_compile_environment
from kvpush.errors import CompileError
from kvpush.models.decoder import CausalLM, decoder_logits

log = logging.getLogger(__name__)

WARM_UP_TOKENS = (2,)  # one forward compiles the one graph
RECOMPILE_LIMIT = 64  # graphs of decoder_logits; engines in one process (tests) each add a few
_num_graphs = 0
_variant: dict[str, bool] = {}  # set by separate_graphs() (benchmarks' A/B)


def num_graphs() -> int:
    """Graphs compiled in this process so far."""
    return _num_graphs


def _counting_inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    global _num_graphs
    _num_graphs += 1
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)  # type: ignore[return-value]


def _compile(fn: Callable) -> Callable:
    """fn(model, input_ids, positions, logit_rows) compiled with the token count (dim 0 of the first two
    tensors) and the rows' count (dim 0 of logit_rows) symbolic, never specialised, and every other size,
    weights' included, static."""
    compiled = torch.compile(fn, backend=_counting_inductor, dynamic=None)
    mark = torch._dynamo.decorators.mark_unbacked

    def run(model, input_ids: torch.Tensor, positions: torch.Tensor,
            logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mark(input_ids, 0)
        mark(positions, 0)
        mark(logit_rows, 0)
        return compiled(model, input_ids, positions, logit_rows)

    return run


@contextlib.contextmanager
def separate_graphs(cpp_wrapper: bool = True) -> Iterator[None]:
    """For A/B benchmarks (benchmarks/engine_ab.py): an engine built inside compiles a graph of its own
    (dynamo would otherwise serve it another engine's graph of the same shapes) with inductor's C++
    wrapper on or off."""
    _variant["cpp_wrapper"] = cpp_wrapper
    try:
        yield
    finally:
        _variant.clear()


def _own_copy(fn: Callable) -> Callable:
    """fn with a code object of its own: dynamo keeps its graphs per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_model(model: CausalLM, mode: CompileMode, warm_up: Callable[[int], None]) -> bool:
    """Give the model a compiled forward (decoder_logits) and compile it by running `warm_up(tokens)` for
    each of WARM_UP_TOKENS.

    Returns True if the model now runs compiled. Raises CompileError only in `on` mode.
    """
    if mode is CompileMode.OFF:
        return False
    apply_compile_environment()
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # compile in this process, on the one core it has
    # No precompiled header: inductor builds it in the system's temporary directory, outside the cache
    # directory, on the first compile after boot. A first start then paid ~5 s for it to save ~2 s
    # (`TMPDIR=<fresh> XDG_CACHE_HOME=<fresh>` engine start-ups, bench model, one core, 2026-12-08: compile
    # 31.3 s with it, 27.4 s without, 25.6 s with one already built); later starts load the compiled graph.
    if hasattr(torch._inductor.config, "cpp_cache_precompile_headers"):  # older torch: no such setting
        torch._inductor.config.cpp_cache_precompile_headers = False
    cpp_wrapper = next(model.parameters()).device.type == "cpu" and _variant.get("cpp_wrapper", True)
    if cpp_wrapper:
        torch._inductor.config.cpp_wrapper = True  # see the module docstring
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    # Without this the warm-up's token count would be unified with any weight dimension of the same
    # size (duck shaping) and the graph specialised to it: every other count would recompile.
    torch.fx.experimental._config.use_duck_shape = False
    skip_isa_checks = cpp_wrapper and _toolchain_builds_native()
    try:
        _compile_and_warm_up(model, cpp_wrapper, skip_isa_checks, warm_up)
    except (torch._dynamo.exc.TorchDynamoException, RuntimeError, OSError) as e:
        if skip_isa_checks:  # perhaps the compiler lacks an instruction set the CPU has: let inductor check
            log.info("compiling with inductor's instruction-set checks after: %s", _first_line(e))
            torch._dynamo.reset()
            try:
                _compile_and_warm_up(model, cpp_wrapper, False, warm_up)
                return True
            except (torch._dynamo.exc.TorchDynamoException, RuntimeError, OSError) as again:
                e = again
        model.compiled_forward = None
        if mode is CompileMode.ON:
            raise CompileError(f"--compile on, but the model cannot be compiled here: {_first_line(e)}") from e
        log.warning("torch.compile is unavailable here (%s); serving eagerly", _first_line(e))
        return False
    return True


def _compile_and_warm_up(model: CausalLM, cpp_wrapper: bool, skip_isa_checks: bool,
                         warm_up: Callable[[int], None]) -> None:
    import torch._inductor.config

    model.compiled_forward = _compile(_own_copy(decoder_logits) if _variant else decoder_logits)
    # vec_isa_ok: inductor takes the CPU's vector instruction sets (read from /proc/cpuinfo) as buildable
    # instead of compiling and loading a test program for each (None: it checks, the default)
    isa_ok = True if skip_isa_checks else torch._inductor.config.cpp.vec_isa_ok
    with torch._inductor.config.patch({"cpp_wrapper": cpp_wrapper, "cpp.vec_isa_ok": isa_ok}):
        for tokens in WARM_UP_TOKENS:
            warm_up(tokens)


def _toolchain_builds_native() -> bool:
    """Whether this machine's C compiler built kvpush's own kernels with -march=native (layers/cpu_kernels.py):
    then it knows every vector instruction set of this CPU, and inductor's own check of each, a test
    program compiled and loaded per set on the first compile, is redundant. That check was ~7 s of a first
    start (`TMPDIR=<fresh> XDG_CACHE_HOME=<fresh>` engine start-ups, bench model, one core, 2026-12-08:
    compile 25.6 and 23.4 s with it, 18.5 and 16.3 s without). Not where the user set
    TORCHINDUCTOR_VEC_ISA_OK: inductor's config then says what they asked."""
    import torch._inductor.config

    from kvpush.layers.cpu_kernels import paged_decode_kernel

    if torch._inductor.config.cpp.vec_isa_ok is not None:
        return False
    return paged_decode_kernel() is not None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
