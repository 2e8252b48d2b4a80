"""The CPU decode-attention kernel (kvpush/layers/cpu_kernels.py): equal to gather + SDPA over the
paged cache, harmless to the process's floating point, optional where no C compiler builds it; and
its row copy (KVCache.write's fast path): the same bytes as the torch ops, or it declines."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_engine import generate, prompts

from kvpush.config import CacheConfig, CompileMode, EngineConfig, ModelConfig
from kvpush.engine.engine import LLMEngine
from kvpush.engine.kv_cache import KVCache, KVLayout
from kvpush.engine.sampling_params import SamplingParams
from kvpush.layers.cpu_kernels import paged_decode_kernel

kernel = paged_decode_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler built the kernel here")


def reference(q, kv, table, lens, layer, scale):
    """gather + SDPA, as layers/attention.py does without the kernel. q: [B, H, hd] -> [B, H, hd]"""
    b, nb = table.shape
    _, _, _, bs, kvh, hd = kv.shape
    k = kv[:, layer, 0][table.flatten()].view(b, nb * bs, kvh, hd).transpose(1, 2)
    v = kv[:, layer, 1][table.flatten()].view(b, nb * bs, kvh, hd).transpose(1, 2)
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",  # head sizes of each of the kernel's paths
                         [(6, 3, 64, 16), (4, 4, 32, 4), (8, 2, 128, 8), (2, 1, 40, 4), (3, 3, 20, 8)])
def test_kernel_equals_gather_and_sdpa(heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_blocks, layers = 64, 3
    kv = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=g)
    lens = torch.tensor([1, block_size, block_size + 1, 5 * block_size - 1, 7 * block_size], dtype=torch.long)
    nb = -(-int(lens.max()) // block_size)
    # distinct blocks per sequence, padded past each length with block 0 as the runner does
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:nb] for _ in lens])
    for i, n in enumerate(lens.tolist()):
        table[i, -(-n // block_size):] = 0
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    for layer in range(layers):
        out = kernel(q, kv, table, lens, layer, head_dim**-0.5)
        torch.testing.assert_close(out, reference(q, kv, table, lens, layer, head_dim**-0.5), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (32, 1, 16),  # 1 vector a head: up to 16 query heads a group over V, two groups here
    (12, 2, 64),  # 4 vectors: 6 query heads a KV head, in groups of 4 and 2
    (12, 2, 48), (6, 1, 80), (4, 1, 112),  # 3, 5, 7 vectors: groups of 5 and 1, 3 and 3, 2 and 2
    (6, 2, 96),  # 6 vectors: 3 query heads, groups of 2 and 1
    (8, 1, 128),  # 8 vectors: groups of 2 heads
    (4, 2, 144),  # over 128: the plain path
])
def test_tiles_and_head_groups_equal_gather_and_sdpa(heads, kv_heads, head_dim):
    """The 16-token tiles (contexts ending inside, on and just past a tile), the 128-token spans over V (a
    context of 300 crosses two) and the query heads of a KV head taken a few at a time, on every head size the
    vector path has (and one it leaves to the plain path)."""
    g = torch.Generator().manual_seed(heads + head_dim)
    num_blocks, block_size = 96, 8
    kv = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, generator=g)
    lens = torch.tensor([1, 15, 16, 17, 31, 33, 64, 128, 129, 300])
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:38] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    torch.testing.assert_close(kernel(q, kv, table, lens, 1, scale), reference(q, kv, table, lens, 1, scale),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_vector_path_is_what_avx512_builds_take():
    """A kernel built with AVX-512 attends heads of 16-128 floats (multiples of 16) by its tile path, others and
    256-bit builds by the plain loops; so the tests above exercise the path they name on such a machine."""
    from kvpush.layers.cpu_kernels import prefill_attention

    wide = (prefill := prefill_attention()) is not None and prefill.width == 16
    assert [kernel.vector_path(d) for d in (16, 64, 128)] == [wide] * 3
    assert not any(kernel.vector_path(d) for d in (8, 40, 144, 256))


def test_the_avx512_path_compiles_where_the_machine_lacks_it(tmp_path):
    """The tile path is only built on AVX-512 CPUs: compile it here anyway (no run), so a machine without
    AVX-512 still checks it builds."""
    from kvpush.config import c_compiler
    from kvpush.layers import cpu_kernels

    flags = [f for f in cpu_kernels.FLAGS if f != "-march=native"] + ["-march=skylake-avx512"]
    subprocess.run([c_compiler(), *flags, "-Werror=implicit-function-declaration", "-c",
                    str(cpu_kernels.SOURCE), "-o", str(tmp_path / "k.o")], check=True, capture_output=True)


def build_variant(tmp_path, extra: list[str]):
    """The kernel built from the current source with `extra` compile flags (e.g. no AVX-512)."""
    import ctypes
    import subprocess

    from kvpush.config import c_compiler
    from kvpush.layers import cpu_kernels

    obj, lib = tmp_path / "kernel.o", tmp_path / "kernel.so"
    subprocess.run([c_compiler(), *cpu_kernels.FLAGS, *extra, "-c", str(cpu_kernels.SOURCE), "-o", str(obj)],
                   check=True, capture_output=True)
    subprocess.run([c_compiler(), str(obj), "-o", str(lib), *cpu_kernels.LINK], check=True, capture_output=True)
    return cpu_kernels.PagedDecode(ctypes.CDLL(str(lib)))


@needs_kernel
@pytest.mark.parametrize("extra", [[], ["-mno-avx512f"]], ids=["native", "256-bit"])
def test_both_vector_widths_equal_gather_and_sdpa(tmp_path, extra):
    """The kernel's 512-bit path (where the CPU has AVX-512) and its 256-bit one, each built here, on head sizes
    that take each of their branches (multiples of 16, of 8 only, neither), and 1, 2 and 4 query heads a KV head."""
    variant = build_variant(tmp_path, extra)
    g = torch.Generator().manual_seed(7)
    for heads, kv_heads, head_dim in ((6, 3, 64), (4, 1, 24), (2, 2, 40), (4, 4, 20), (8, 2, 128)):
        kv = torch.randn(32, 2, 2, 4, kv_heads, head_dim, generator=g)
        lens = torch.tensor([1, 4, 5, 21, 33])
        table = torch.stack([torch.randperm(32, generator=g)[:9] for _ in lens])
        q = torch.randn(len(lens), heads, head_dim, generator=g)
        torch.testing.assert_close(variant(q, kv, table, lens, 1, 0.3), reference(q, kv, table, lens, 1, 0.3),
                                   rtol=1e-5, atol=1e-5)


@needs_kernel
def test_loading_it_keeps_subnormals():
    """The library is compiled with -ffast-math but must not switch the process to flush-to-zero."""
    assert 5e-324 * 1.0 != 0.0
    assert (torch.tensor(1e-39) * 0.5).item() != 0.0


@needs_kernel
def test_engine_greedy_with_kernel_equals_gather_path(tiny_model):
    eng = LLMEngine(EngineConfig(ModelConfig(tiny_model), CacheConfig(block_size=4, num_blocks=256),
                                 compile=CompileMode.OFF))
    other = LLMEngine(dataclasses.replace(eng.config))
    assert eng.runner.decode_kernel is not None
    other.runner.decode_kernel = None
    ps = prompts(eng.arch.vocab_size, (1, 4, 7, 13, 30, 61))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert generate(eng, ps, params) == generate(other, ps, params)


SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
from kvpush.config import CacheConfig, CompileMode, EngineConfig, ModelConfig
from kvpush.engine.engine import LLMEngine
from kvpush.engine.sampling_params import SamplingParams
eng = LLMEngine(EngineConfig(ModelConfig(sys.argv[1]), CacheConfig(num_blocks=32), compile=CompileMode.OFF))
eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
while eng.has_unfinished():
    eng.step()
print("SERVED kernel=%s" % (eng.runner.decode_kernel is not None))
"""


def test_without_a_c_compiler_attention_gathers(tiny_model, tmp_path):
    """--decode-attention auto takes gather + SDPA, saying why; kernel forced stops start-up, saying why."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "KVPUSH_DECODE_ATTENTION": "auto", "KVPUSH_PREFILL_ATTENTION": "auto"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model], env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "SERVED kernel=False" in out
    assert len([line for line in out.splitlines() if "decode attention gathers blocks instead" in line]) == 1, out
    assert "decode attention: sdpa (the C kernel could not be built here" in out
    assert "prefill attention: sdpa (the C kernel could not be built here" in out
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model], env={**env, "KVPUSH_DECODE_ATTENTION": "kernel"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--decode-attention kernel: the C kernel could not be built here" in proc.stderr


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_copy_writes_what_the_torch_ops_write(dtype):
    layout = KVLayout(num_blocks=6, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    fast, slow = KVCache(layout), KVCache(layout)
    assert fast.row_writer is not None
    slow.row_writer = None
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 4 * 16, generator=g).to(dtype)  # a fused projection's output
    q, k, v = qkv.split([32, 16, 16], dim=-1)  # views: each token's row contiguous, tokens 64 apart
    k, v = k.view(5, 2, 8), v.view(5, 2, 8)
    blocks, offsets = torch.tensor([5, 5, 0, 3, 1]), torch.tensor([0, 3, 1, 2, 3])
    for cache in (fast, slow):
        rows = cache.slot_rows(blocks, offsets)
        cache.write(2, rows, k, v)
        cache.write(0, rows, k.contiguous() * 2, v.contiguous())
    assert torch.equal(fast.kv, slow.kv)
    assert fast.kv.count_nonzero() > 0


@needs_kernel
def test_row_copy_declines_what_it_cannot_copy():
    layout = KVLayout(num_blocks=2, num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache = KVCache(layout)
    writer = cache.row_writer
    assert writer is not None
    rows = cache.slot_rows(torch.tensor([1, 0]), torch.tensor([0, 1]))
    k = torch.randn(2, 2, 8)
    for bad_k, bad_v in ((k.double(), k), (k.transpose(1, 2).contiguous().transpose(1, 2), k), (k, k[:1])):
        assert not writer(cache.kv, rows, bad_k, bad_v, 0)
    assert cache.kv.count_nonzero() == 0
    cache.write(0, rows, k.transpose(1, 2).contiguous().transpose(1, 2), k)  # the torch ops take it
    assert torch.equal(cache.kv.view(-1, 16)[rows[0]], k[0].flatten())


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 3, 64), (2, 1, 40)])
def test_write_and_decode_in_one_call_equals_write_then_kernel(heads, kv_heads, head_dim):
    """DecodeStep (one C call a layer) leaves the cache and returns the output that KVCache.write followed by
    the kernel give; where q or a K/V row is not contiguous it does nothing and says so (None)."""
    layout = KVLayout(num_blocks=12, num_layers=2, block_size=4, num_kv_heads=kv_heads, head_dim=head_dim,
                      dtype=torch.float32)
    fused, split = KVCache(layout), KVCache(layout)
    g = torch.Generator().manual_seed(3)
    fused.kv.normal_(generator=g)
    split.kv.copy_(fused.kv)
    lens = torch.tensor([3, 9, 16])  # the new token is each sequence's last
    table = torch.tensor([[4, 0, 0, 0], [7, 2, 9, 0], [1, 3, 5, 11]])
    blocks = table[torch.arange(3), (lens - 1) // 4]
    rows = fused.slot_rows(blocks, (lens - 1) % 4)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim, generator=g)  # k and v: views, rows apart
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.reshape(3, heads, head_dim).contiguous(), k.view(3, kv_heads, head_dim), v.view(3, kv_heads, head_dim)
    step = kernel.bind(fused.kv, rows, table, lens)
    assert step is not None
    for layer in (1, 0):
        out = step(q, k, v, layer, head_dim**-0.5)
        split.write(layer, rows, k, v)
        assert torch.equal(out, kernel(q, split.kv, table, lens, layer, head_dim**-0.5))
    assert torch.equal(fused.kv, split.kv)
    before = fused.kv.clone()
    assert step(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, 0, 1.0) is None
    assert step(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 0, 1.0) is None
    assert step(q[:2], k[:2], v[:2], 0, 1.0) is None  # not the batch it was bound to
    assert step(q.double(), k.double(), v.double(), 0, 1.0) is None
    assert torch.equal(fused.kv, before)
