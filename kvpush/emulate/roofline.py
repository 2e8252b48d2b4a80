"""GPU profiles from a roofline: hardware constants, the model's shape per rank, and efficiencies.

    per_token_s         = (2 * linear params per rank) / (peak FLOPS * compute_efficiency)
                          + tensor-parallel all-reduce bytes per token / NVLink bandwidth
    per_pair_s          = (4 * query heads per rank * head_dim * layers) / (peak FLOPS * compute_efficiency)
    per_step_s          = linear weight bytes per rank / (HBM bandwidth * memory_efficiency)
    per_context_token_s = KV bytes per token per rank / (HBM bandwidth * memory_efficiency)
    step_overhead_s     = host_step_s + 2 * layers * allreduce_latency_s (TP > 1)

The numbers and their sources live in `HARDWARE`, `MODELS` and `Efficiencies`; `build` writes them
into the profile's `sources` and `derivation`, so a profile file says where each constant came from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvpush.emulate.profile import DTYPE_BYTES, KVGeometry, Link, Profile, StepClock


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense BF16 tensor-core FLOP/s
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # one direction, per GPU
    link_gbps: float  # the scale-out network per GPU (Gbit/s)
    link_latency_s: float
    source: str


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    source: str
    dtype: str = "bfloat16"

    def linear_params(self) -> int:
        """Parameters every token multiplies: attention and MLP projections, and the LM head."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (2 * q + kv + mlp) + self.hidden_size * self.vocab_size


@dataclass(frozen=True)
class Efficiencies:
    compute: float  # fraction of peak FLOPS a prefill reaches
    memory: float  # fraction of HBM bandwidth a decode step reaches
    host_step_s: float  # the serving engine's own time per step (scheduling, launches, sampling)
    prefill_step_s: float  # more of it in a step that prefills (no CUDA graph)
    allreduce_latency_s: float  # one small all-reduce across the TP group
    source: str


EFA_GBPS_PER_GPU = 3200 / 8
LINK_SOURCE = ("AWS p5 / p5en instance specifications: 3,200 Gbps of EFA per 8 GPUs, i.e. 400 Gbps per GPU; "
               "latency: an assumed 20 us one way for RDMA over EFA (not measured)")
HARDWARE = {
    "h100": Hardware("H100 SXM", 989e12, 3.35e12, 450e9, EFA_GBPS_PER_GPU, 20e-6,
                     "NVIDIA H100 SXM datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, NVLink 900 GB/s "
                     "(450 GB/s each way); " + LINK_SOURCE),
    "h200": Hardware("H200 SXM", 989e12, 4.8e12, 450e9, EFA_GBPS_PER_GPU, 20e-6,
                     "NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16 (the H100's), 4.8 TB/s HBM3e, "
                     "NVLink 900 GB/s (450 GB/s each way); " + LINK_SOURCE),
}
MODELS = {
    "qwen3-8b": ModelShape("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, 40960,
                           "Qwen/Qwen3-8B config.json: hidden_size 4096, intermediate_size 12288, "
                           "num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8, head_dim 128, "
                           "vocab_size 151936, tie_word_embeddings false, max_position_embeddings 40960, bfloat16"),
    "qwen3-32b": ModelShape("Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, 40960,
                            "Qwen/Qwen3-32B config.json: hidden_size 5120, intermediate_size 25600, "
                            "num_hidden_layers 64, num_attention_heads 64, num_key_value_heads 8, head_dim 128, "
                            "vocab_size 151936, tie_word_embeddings false, max_position_embeddings 40960, "
                            "bfloat16"),
}


def clock_of(model: ModelShape, hw: Hardware, eff: Efficiencies, tp: int = 1) -> StepClock:
    width = DTYPE_BYTES[model.dtype]
    compute = hw.peak_flops * eff.compute
    memory = hw.hbm_bytes_per_s * eff.memory
    params = model.linear_params() / tp
    allreduce = 0.0 if tp == 1 else 2 * model.num_layers * model.hidden_size * width * 2 * (tp - 1) / tp
    attn_flops = 4 * (model.num_heads // tp) * model.head_dim * model.num_layers
    return StepClock(
        step_overhead_s=eff.host_step_s + (2 * model.num_layers * eff.allreduce_latency_s if tp > 1 else 0.0),
        prefill_overhead_s=eff.prefill_step_s,
        per_token_s=2 * params / compute + allreduce / hw.nvlink_bytes_per_s,
        per_pair_s=attn_flops / compute,
        per_step_s=params * width / memory,
        per_context_token_s=kv_geometry(model, tp).bytes_per_token / memory,
        combine="max")


def kv_geometry(model: ModelShape, tp: int) -> KVGeometry:
    return KVGeometry(model.num_layers, max(model.num_kv_heads // tp, 1), model.head_dim, model.dtype)


def build(name: str, model: ModelShape, hw: Hardware, eff: Efficiencies, tp: int = 1,
          description: str = "") -> Profile:
    """The profile of one rank of `model` at tensor parallelism `tp` on `hw`."""
    roofline = "kvpush/emulate/roofline.py from the hardware, the model's shape and the efficiencies (derivation)"
    sources = {f"kv.{k}": f"{model.source}; per rank at TP{tp}" for k in ("num_layers", "num_kv_heads",
                                                                          "head_dim", "dtype")}
    sources |= {f"clock.{k}": roofline for k in ("step_overhead_s", "prefill_overhead_s", "per_token_s",
                                                  "per_pair_s", "per_step_s", "per_context_token_s")}
    sources |= {"link.bandwidth_gbps": hw.source, "link.latency_s": hw.source,
                "hardware": hw.source, "efficiencies": eff.source, "model": model.source}
    derivation = {"tp": tp, "hardware": asdict(hw), "model": asdict(model), "efficiencies": asdict(eff)}
    return Profile(name, "cuda", kv_geometry(model, tp), clock_of(model, hw, eff, tp),
                   Link(hw.link_gbps, hw.link_latency_s), model.max_model_len, description, sources, derivation)
