"""Engine over real checkpoints: logits parity with transformers, greedy invariance, bad input.

Tolerance for logits parity: max abs difference 1e-4 on fp32 logits (both implementations run the
same fp32 math; differences come only from operation order). On CUDA 2e-3: both sides run fp32, but
the GPU's kernels (SDPA, cuBLAS) sum in other orders for different shapes.

Tests taking `device` run on cpu and cuda (skipped: "no CUDA device" where there is no GPU).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpush_testing import devices

from kvpush.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvpush.engine.engine import CPU_PREFILL_JOIN_TOKENS, LLMEngine
from kvpush.engine.sampling_params import SamplingParams
from kvpush.errors import InvalidRequestError, ModelLoadError

ATOL = {"cpu": 1e-4, "cuda": 2e-3}
DEVICES = devices()
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def engine(model: str, num_blocks: int = 128, block_size: int = 4, budget: int = 512, chunked: bool = True,
           prefix: bool = True, max_seqs: int = 32, device: str = "cpu", join: int | None = None,
           long_prefill: int | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model, device=device),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_seqs, budget, chunked, join, long_prefill)))


def generate(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    ids = [eng.add_request(f"r{i}-{eng.step_count}-{id(p)}", p, params).request_id for i, p in enumerate(prompts)]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    return [outs[i] for i in ids]


def prompts(vocab: int, lengths=(1, 4, 7, 13, 30)) -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def ours_logits(eng: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """Logits of every position from one prefill over the paged cache. -> [n, vocab]"""
    req = eng.make_request("logits", tokens, SamplingParams(max_tokens=1))
    assert eng.block_manager.allocate(req, len(tokens))
    batch = eng.runner.prepare([(req, len(tokens))])
    with torch.inference_mode():
        out, _ = eng.model(batch.input_ids, batch.positions, batch.meta, eng.cache,
                           torch.arange(len(tokens), device=eng.device))
    eng.block_manager.free(req)
    return out.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_logits_and_decode_match_transformers(arch, device, tiny_model, llama_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model if arch == "qwen3" else llama_model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    eng = engine(path, device=device)
    assert eng.cache.kv.device.type == device and next(eng.model.parameters()).device.type == device
    expected_cls = "Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"
    assert type(hf).__name__ == expected_cls
    prompt = prompts(eng.arch.vocab_size, (21,))[0]
    [ours] = generate(eng, [prompt])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        hf_logits = hf(torch.tensor([prompt + ours], device=device)).logits[0].cpu()
    assert ours == ref
    # prefill logits plus the logits of every decode step, all positions at once
    diff = (ours_logits(eng, prompt + ours) - hf_logits).abs().max().item()
    assert diff < ATOL[device], diff
    assert hf_logits.std() > 0.5  # the check is meaningful: logits are not all ~0


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_batched_equals_one_at_a_time(tiny_model, device):
    eng = engine(tiny_model, device=device)
    ps = prompts(eng.arch.vocab_size)
    batched = generate(eng, ps)
    single = [generate(engine(tiny_model, device=device), [p])[0] for p in ps]
    assert batched == single


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_equals_whole_prefill(tiny_model, device):
    ps = prompts(1000, (30, 45, 9))
    whole = generate(engine(tiny_model, budget=512, device=device), ps)
    chunked = generate(engine(tiny_model, budget=8, device=device), ps)
    assert whole == chunked


@pytest.mark.parametrize("device", DEVICES)
def test_prefills_packed_or_one_at_a_time_give_the_same_tokens(tiny_model, device):
    ps = prompts(1000, (30, 45, 9, 20))
    packed, serial = engine(tiny_model, join=-1, device=device), engine(tiny_model, join=0, device=device)
    assert generate(packed, ps) == generate(serial, ps)
    assert serial.step_count > packed.step_count  # the prefills ran in steps of their own


@pytest.mark.parametrize("device", DEVICES)
def test_long_prefills_in_chunks_beside_decodes_give_the_same_tokens(tiny_model, device):
    """Prompts arriving while others decode, prefilled in chunks of 7 tokens (steps decode the others
    in between), answer as with whole prefills."""
    ps = prompts(1000, (30, 45, 9, 20))

    def staggered(eng: LLMEngine) -> list[list[int]]:
        outs: dict[str, list[int]] = {f"s{i}": [] for i in range(len(ps))}
        for i, p in enumerate(ps):
            eng.add_request(f"s{i}", p, GREEDY)
            for _ in range(3 if i == 1 else 0):  # the others arrive while the first two run
                for o in eng.step():
                    outs[o.request_id].extend(o.new_token_ids)
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id].extend(o.new_token_ids)
        return list(outs.values())

    whole, chunks = engine(tiny_model, device=device), engine(tiny_model, device=device, long_prefill=7)
    assert chunks.scheduler.chunk_limit == 7 and whole.scheduler.chunk_limit == 0  # colocated: off by default
    assert staggered(whole) == staggered(chunks)
    assert chunks.step_count > whole.step_count


def test_a_decode_instance_chunks_long_prefills_by_default(tiny_model):
    from kvpush.engine.engine import CPU_LONG_PREFILL_TOKENS
    from kvpush.engine.kv_connector import KVConnector
    from kvpush.transfer.decode_connector import DecodeConnector
    from kvpush.transfer.prefill_connector import PrefillConnector

    class Decoding(KVConnector):  # the role is all the engine asks of it here
        decodes = True

        def on_add(self, request, params) -> None:
            return None

        def poll(self) -> list:
            return []

    assert DecodeConnector.decodes and not PrefillConnector.decodes
    eng = engine(tiny_model)
    assert eng.scheduler.chunk_limit == 0  # colocated: off (vLLM's default)
    eng.set_connector(Decoding())
    assert eng.scheduler.chunk_limit == CPU_LONG_PREFILL_TOKENS
    explicit = engine(tiny_model, long_prefill=0)
    explicit.set_connector(Decoding())
    assert explicit.scheduler.chunk_limit == 0


def test_prefill_join_limit_by_device(tiny_model):
    assert engine(tiny_model).scheduler.join_limit == CPU_PREFILL_JOIN_TOKENS
    assert engine(tiny_model, join=-1).scheduler.join_limit == -1


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_cache_hit_equals_cold(tiny_model, device):
    eng = engine(tiny_model, device=device)
    base = prompts(eng.arch.vocab_size, (24,))[0]
    cold = generate(engine(tiny_model, prefix=False, device=device), [base + [5, 6, 7]])
    generate(eng, [base])  # fills the cache with base's full blocks
    hits_before = eng.block_manager.num_hits
    warm = generate(eng, [base + [5, 6, 7]])
    assert eng.block_manager.num_hits == hits_before + 1
    assert warm == cold


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_by_tiny_cache_gives_same_output(tiny_model, device):
    ps = prompts(1000, (10, 11, 12, 13))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = generate(engine(tiny_model, device=device), ps, params)
    small = engine(tiny_model, num_blocks=16, block_size=4, device=device)
    reqs = [small.add_request(f"p{i}", p, params) for i, p in enumerate(ps)]
    while small.has_unfinished():
        small.step()
    assert sum(r.num_preemptions for r in reqs) > 0  # the tiny cache really forced preemption
    assert [r.output_token_ids for r in reqs] == roomy
    assert small.block_manager.num_free_blocks == 16
    small.block_manager.check_invariants()


def test_abort_frees_blocks(tiny_model):
    eng = engine(tiny_model, num_blocks=32)
    eng.add_request("a", list(range(3, 20)), GREEDY)
    eng.add_request("b", list(range(3, 9)), GREEDY)
    eng.step()
    assert eng.abort_request("a")
    assert not eng.abort_request("a")
    while eng.has_unfinished():
        eng.step()
    assert eng.block_manager.num_free_blocks == 32
    eng.block_manager.check_invariants()


def test_seeded_sampling_is_reproducible_across_batches(tiny_model):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    ps = prompts(1000, (5, 9, 14))
    alone = generate(engine(tiny_model), [ps[1]], params)[0]
    together = generate(engine(tiny_model), ps, params)[1]
    assert alone == together


def test_stop_token_and_max_tokens(tiny_model):
    eng = engine(tiny_model)
    p = prompts(1000, (8,))[0]
    [free_run] = generate(eng, [p])
    stop_at = free_run[3]
    [stopped] = generate(eng, [p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at],
                                                  ignore_eos=True))
    assert stopped == free_run[: free_run.index(stop_at) + 1]
    [short] = generate(eng, [p], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert short == free_run[:3]


def test_logprobs_of_sampled_tokens(tiny_model):
    eng = engine(tiny_model)
    req = eng.add_request("lp", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, logprobs=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert len(req.output_logprobs) == 3
    for tok, lp in zip(req.output_token_ids, req.output_logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 4
        assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-6  # greedy = top-1
        assert lp.logprob <= 0


@pytest.mark.parametrize("prompt, match", [([], "empty"), (list(range(5000)), "maximum context length"),
                                          ([1, 10**7], "outside the vocabulary")])
def test_bad_prompts_are_rejected(tiny_model, prompt, match):
    eng = engine(tiny_model)
    with pytest.raises(InvalidRequestError, match=match):
        eng.add_request("bad", prompt, GREEDY)
    assert not eng.has_unfinished()


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0},
                                    {"top_k": -5}, {"logprobs": 99}, {"stop": [""]}])
def test_bad_sampling_values_are_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_prompt_larger_than_cache_is_rejected(tiny_model):
    eng = engine(tiny_model, num_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError, match="KV cache"):
        eng.add_request("big", list(range(3, 40)), GREEDY)


def test_bad_checkpoints(tmp_path, tiny_model):
    import json
    import shutil

    with pytest.raises(ModelLoadError, match="config.json"):
        engine(str(tmp_path))
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        engine(str(bad))
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weight"):
        engine(str(bad))


def test_cuda_without_a_gpu_is_a_clear_error(tiny_model):
    """--device cuda on a machine without one fails before anything starts, saying so."""
    from kvpush.cli import main
    from kvpush.engine.device import resolve_device
    from kvpush.errors import DeviceError

    for bad, match in (("meta", "only cpu and cuda"), ("cuda:x", "not a device name")):
        with pytest.raises(DeviceError, match=match):
            resolve_device(bad)
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.device("cuda", 0)
        with pytest.raises(DeviceError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
        return
    with pytest.raises(DeviceError, match="no CUDA device is available"):
        engine(tiny_model, device="cuda")
    with pytest.raises(SystemExit, match="no CUDA device is available"):
        main(["serve", tiny_model, "--device", "cuda"])


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30])
def test_tiny_temperature_samples_the_argmax_instead_of_crashing(temperature):
    """row / temperature overflowed to inf for subnormal temperatures, and softmax(inf - inf) = nan
    crashed the engine core (found by the proxy fuzz test)."""
    from kvpush.layers.sampler import _sample_row
    row = torch.tensor([0.5, 3.0, -1.0, float("-inf"), 2.9])
    assert _sample_row(row, temperature, 0, 1.0, torch.Generator().manual_seed(0)) == 1
    assert _sample_row(row, temperature, 2, 0.5, torch.Generator().manual_seed(0)) == 1


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-46])
def test_top_p_below_fp32_resolution_keeps_the_most_likely_token(top_p):
    """A top_p that rounds to 0 in fp32 dropped every token: all -inf, nan probabilities, a dead
    engine core (found by the proxy fuzz test)."""
    from kvpush.layers.sampler import _sample_row
    row = torch.tensor([0.5, 3.0, -1.0, float("-inf"), 2.9])
    assert _sample_row(row, 1.0, 0, top_p, torch.Generator().manual_seed(0)) == 1


@settings(max_examples=300, deadline=None)
@given(temperature=st.floats(0.0, 100.0, exclude_min=True), top_k=st.integers(-1, 8),
       top_p=st.floats(0.0, 1.0, exclude_min=True), seed=st.integers(0, 2**16))
def test_any_valid_sampling_params_sample_a_finite_logit(temperature, top_k, top_p, seed):
    """Every combination SamplingParams accepts samples a token that was not masked to -inf."""
    from kvpush.layers.sampler import _sample_row
    row = torch.randn(11, generator=torch.Generator().manual_seed(seed)) * 5
    row[[2, 7]] = float("-inf")  # suppressed stop tokens
    token = _sample_row(row, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    assert torch.isfinite(row[token])
