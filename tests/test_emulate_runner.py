"""The emulated runner through the offline LLM (kvpush/emulate/runner.py, kv_pattern.py, lateness.py): the KV
cache in the profile's geometry, deterministic bytes and tokens read back from them, lateness accounting.
A tiny time scale keeps every run short; nothing here asserts a duration of this machine."""

from __future__ import annotations

import pytest
import torch

from kvpush import LLM, SamplingParams
from kvpush.emulate.lateness import LatenessLog, quantile
from kvpush.emulate.profile import load_profile

SCALE = 1e-3
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, emulate="qwen3-32b-h200-tp8", time_scale=SCALE, block_size=8, num_blocks=256)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 17) % 900 + 3 for i in range(n)]


def test_the_cache_has_the_profiles_geometry(llm):
    layout = llm.engine.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (64, 1, 128, torch.bfloat16)
    assert layout.block_bytes == 8 * 32 * 1024  # 32 KiB a token per rank
    assert llm.engine.max_model_len == load_profile("qwen3-32b-h200-tp8").max_model_len
    assert not hasattr(llm.engine, "model")  # no weights loaded


def test_outputs_are_deterministic_and_in_the_ordinary_vocabulary(llm, tiny_model):
    prompts = [_prompt(20, 1), _prompt(37, 2), _prompt(5, 3)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert batched == alone  # a request's tokens do not depend on its batch
    again = LLM(tiny_model, emulate="qwen3-32b-h200-tp8", time_scale=SCALE, block_size=8, num_blocks=256,
                enable_prefix_caching=False)
    assert [o.token_ids for o in again.generate(prompts, GREEDY)] == alone  # another engine, no prefix cache
    assert len({tuple(t) for t in alone}) == 3
    special = llm.tokenizer.special_token_ids() | llm.engine.eos_token_ids
    assert all(0 <= t < llm.tokenizer.vocab_size and t not in special for t in sum(alone, []))


def test_chunked_prefill_gives_the_same_tokens(tiny_model, llm):
    prompt = _prompt(50, 4)
    chunked = LLM(tiny_model, emulate="qwen3-32b-h200-tp8", time_scale=SCALE, block_size=8, num_blocks=256,
                  max_num_batched_tokens=16)
    assert chunked.generate([prompt], GREEDY)[0].token_ids == llm.generate([prompt], GREEDY)[0].token_ids


def test_the_token_is_read_back_from_the_kv(llm):
    """Flip one bit of a cached prompt block: a request that takes that prefix from the cache (as D takes a
    transfer's blocks) reads it back, and its tokens change."""
    prompt = _prompt(24, 5)
    expected = llm.generate([prompt], GREEDY)[0].token_ids
    cached = llm.engine.block_manager.find_cached_prefix_tokens(prompt)
    assert cached and llm.generate([prompt], GREEDY)[0].token_ids == expected  # a prefix hit reads the same
    llm.engine.cache.kv[cached[0]].view(torch.int16).view(-1)[0] ^= 1  # layer 0's first K row, one bit
    assert llm.generate([prompt], GREEDY)[0].token_ids != expected


def test_every_step_records_its_lateness(llm):
    before = llm.engine.emulation_stats()
    llm.generate([_prompt(9, 6)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    after = llm.engine.emulation_stats()
    assert after.profile == "qwen3-32b-h200-tp8" and after.time_scale == SCALE
    assert after.steps == before.steps + 4  # the prefill and three decodes
    assert sum(after.lateness_counts) == after.steps and after.lateness_sum_s >= 0
    assert after.modelled_s > before.modelled_s


def test_the_time_scale_stretches_modelled_time(tiny_model):
    runs = {}
    for scale in (1e-4, 2e-4):
        llm = LLM(tiny_model, emulate="qwen3-8b-h100", time_scale=scale, block_size=8, num_blocks=64)
        llm.generate([_prompt(16, 7)], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        runs[scale] = llm.engine.emulation_stats().modelled_s
    clock = load_profile("qwen3-8b-h100").clock
    steps = clock.prefill_time(16) + clock.decode_time([17]) + clock.decode_time([18])
    assert runs[1e-4] == pytest.approx(steps * 1e-4)
    assert runs[2e-4] == pytest.approx(2 * runs[1e-4])


def test_lateness_log():
    log = LatenessLog("p", 1.0)
    for late in (0.0, 3e-5, 2e-3, 0.5):
        log.record(0.01, late)
    stats = log.stats()
    assert stats.steps == 4 and stats.lateness_max_s == 0.5 and stats.modelled_s == pytest.approx(0.04)
    assert stats.lateness_counts[0] == 1 and sum(stats.lateness_counts) == 4
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and quantile([], 0.99) == 0.0
    assert stats.lateness_p99_s == 0.5


def test_emulation_refuses_a_real_device(tiny_model):
    with pytest.raises(ValueError, match="cannot go with --device cuda"):
        LLM(tiny_model, emulate="qwen3-8b-h100", device="cuda")


def test_an_emulated_instance_never_pairs_with_a_real_one(llm, tiny_model):
    """The compatibility hash takes the engine's kv_origin: empty for the model, the profile (name, a hash of
    its geometry, clock and link) and the time scale when emulated."""
    origin = llm.engine.kv_origin
    profile = load_profile("qwen3-32b-h200-tp8")
    assert origin == f"emulated:qwen3-32b-h200-tp8:{profile.fingerprint}:x{SCALE:g}"
    assert LLM(tiny_model, block_size=8, num_blocks=16).engine.kv_origin == ""


def test_resetting_the_window_keeps_the_life_long_counts():
    log = LatenessLog("p", 1.0)
    for late in (0.5, 0.4):
        log.record(0.01, late)
    assert log.stats().window_steps == 2 and log.stats().lateness_p99_s == 0.5
    log.reset_window()
    stats = log.stats()
    assert stats.window_steps == 0 and stats.lateness_p99_s == 0.0 and stats.step_p50_s == 0.0
    assert stats.steps == 2 and sum(stats.lateness_counts) == 2 and stats.lateness_max_s == 0.5
    log.record(0.02, 1e-4)
    stats = log.stats()
    assert stats.window_steps == 1 and stats.lateness_p99_s == 1e-4 and stats.step_p50_s == 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_read_back_gives_the_torch_sums(dtype):
    """layers/kv_digest.c against the torch path, bit for bit, over random bytes (negative halves and all),
    scattered block tables and spans that start and end inside blocks."""
    from kvpush.emulate.kv_pattern import KVPattern
    from kvpush.engine.kv_cache import KVCache, KVLayout

    cache = KVCache(KVLayout(num_blocks=40, num_layers=3, block_size=8, num_kv_heads=2, head_dim=4, dtype=dtype))
    native = KVPattern(cache, vocab_size=100, max_positions=300)
    if native.native is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    plain = KVPattern(cache, vocab_size=100, max_positions=300, native=False)
    gen = torch.Generator().manual_seed(7)
    cache.kv.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, cache.kv.view(torch.int16).shape,
                                                   dtype=torch.int16, generator=gen))
    table = torch.randperm(40, generator=gen)[:30].tolist()
    spans = [(table, 0, 240), (table, 3, 5), (table, 7, 9), (table, 100, 100), (table[:2], 0, 16), (table, 17, 239)]
    got = native.digests(spans)
    assert got == plain.digests(spans)
    head, tail = native.digests([(table, 0, 17), (table, 239, 240)])
    assert got[1] != 0 and got[0] == head + got[5] + tail  # adjacent spans add up (no wrap at this size)


def test_the_c_read_back_refuses_a_span_past_its_table():
    from kvpush.layers.cpu_kernels import kv_digest

    fn = kv_digest()
    if fn is None:
        pytest.skip("no C compiler here")
    kv = torch.zeros(4, 2, 2, 8, 1, 4, dtype=torch.bfloat16)
    weights = torch.zeros(100, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit"):
        fn(kv, torch.tensor([0, 1]), 0, 17, *weights)  # 17 positions, 2 blocks of 8
    with pytest.raises(ValueError, match="do not fit"):
        fn(kv, torch.tensor([0, 9]), 0, 16, *weights)  # block 9 of 4
    assert fn(kv, torch.tensor([0, 1]), 0, 16, *weights) == 0
