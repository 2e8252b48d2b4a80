"""The C prefill attention (layers/prefill_attention.c, cpu_kernels.PrefillAttention): equal to the SDPA path
of layers/attention.py on fresh prompts and on chunks after earlier context, across head shapes, key chunk
boundaries and both vector widths; it declines what it cannot take. No test asserts a speed."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from kvpush.config import c_compiler
from kvpush.engine.kv_cache import KVCache, KVLayout
from kvpush.layers import cpu_kernels
from kvpush.layers.attention import AttentionMetadata, PrefillSeq, prefill_one

kernel = cpu_kernels.prefill_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler built the kernel here")


def sdpa_path(q, k, v, offset: int, scale: float, block_size: int = 4) -> torch.Tensor:
    """layers/attention.prefill_one without the kernel: q [T, H, hd], k, v [ctx, kvh, hd] (the context
    written into a scratch cache with scattered blocks when offset > 0) -> [T, H, hd]"""
    t, ctx = q.shape[0], k.shape[0]
    nb = -(-ctx // block_size)
    cache = KVCache(KVLayout(nb + 1, 1, block_size, k.shape[1], k.shape[2], k.dtype))
    table = torch.randperm(nb, generator=torch.Generator().manual_seed(ctx)) + 1
    positions = torch.arange(ctx)
    cache.write(0, cache.slot_rows(table[positions // block_size], positions % block_size), k, v)
    seq = PrefillSeq(0, t, ctx, table)
    return prefill_one(q, k[offset:], v[offset:], seq, 0, cache, scale, AttentionMetadata(torch.empty(0)))


SHAPES = [(6, 3, 64), (4, 4, 32), (8, 1, 128), (2, 2, 16), (32, 8, 128)]  # heads, kv heads, head_dim
LENGTHS = [(1, 1), (3, 3), (37, 37), (300, 300), (600, 600), (1, 40), (5, 517), (64, 1100), (256, 1300)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_the_kernel_equals_the_sdpa_path(heads, kv_heads, head_dim):
    """Fresh prompts below, inside and above the SDPA path's piece range, chunks after context across the
    kernel's 512-key chunks, one-row chunks (the last position of a held prompt)."""
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    for t, ctx in LENGTHS:
        q = torch.randn(t, heads, head_dim, generator=g)
        k, v = (torch.randn(ctx, kv_heads, head_dim, generator=g) for _ in range(2))
        scale = head_dim**-0.5
        out = kernel(q, k, v, scale)
        assert out is not None and out.shape == (t, heads, head_dim) and out.is_contiguous()
        torch.testing.assert_close(out, sdpa_path(q, k, v, ctx - t, scale), rtol=2e-5, atol=2e-5)


def test_strided_rows_and_large_scores():
    """q, k and v as views into one projection output (the model's split), scores far from zero (the
    softmax's max subtraction and the exp's range), and rows that see a single key."""
    g = torch.Generator().manual_seed(3)
    t, heads, kv_heads, hd = 70, 4, 2, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * hd, generator=g) * 6  # [T, (H + 2 kvh) hd]
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k, v = q.view(t, heads, hd), k.view(t, kv_heads, hd), v.view(t, kv_heads, hd)
    assert not q.is_contiguous()
    out = kernel(q, k, v, 1.0)
    assert out is not None and torch.isfinite(out).all()
    # scores of ~200: fp32 rounding of a score moves its weight by ~1e-5 relative, values are ~6
    torch.testing.assert_close(out, sdpa_path(q.contiguous(), k.contiguous(), v.contiguous(), 0, 1.0),
                               rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(2, 0))  # row 0 sees key 0 only


def test_it_declines_what_it_cannot_take():
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    assert kernel(q.bfloat16(), k.bfloat16(), k.bfloat16(), 1.0) is None  # fp32 only
    assert kernel(q[:, :, :12].contiguous(), k[:, :, :12].contiguous(), k[:, :, :12].contiguous(), 1.0) is None
    assert kernel(torch.randn(5, 2, 16), k, k, 1.0) is None  # more rows than context
    assert kernel(torch.randn(4, 3, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), 1.0) is None  # 3 over 2
    k2 = torch.randn(4, 2, 16)
    assert kernel(q, k2, torch.randn(4, 16, 2).transpose(1, 2), 1.0) is None  # a value row not contiguous
    assert kernel(q, k2, k2, 1.0) is not None


def test_the_256_bit_build_equals_the_sdpa_path(tmp_path):
    """The kernel built without AVX-512 (8-float vectors), on head sizes of multiples of 8."""
    obj, lib = tmp_path / "prefill.o", tmp_path / "prefill.so"
    subprocess.run([c_compiler(), *cpu_kernels.FLAGS, "-mno-avx512f", "-c", str(cpu_kernels.PREFILL_SOURCE), "-o",
                    str(obj)], check=True, capture_output=True)
    subprocess.run([c_compiler(), str(obj), "-o", str(lib), *cpu_kernels.LINK], check=True, capture_output=True)
    narrow = cpu_kernels.PrefillAttention(ctypes.CDLL(str(lib)))
    g = torch.Generator().manual_seed(5)
    for (t, ctx), (heads, kv_heads, hd) in zip([(40, 40), (9, 700), (530, 530)], [(6, 3, 64), (4, 2, 24), (2, 1, 8)],
                                               strict=True):
        q = torch.randn(t, heads, hd, generator=g)
        k, v = (torch.randn(ctx, kv_heads, hd, generator=g) for _ in range(2))
        out = narrow(q, k, v, 0.2)
        assert out is not None
        torch.testing.assert_close(out, sdpa_path(q, k, v, ctx - t, 0.2), rtol=2e-5, atol=2e-5)
