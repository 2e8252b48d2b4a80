"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a CausalLM."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from kvpush.config import LinearBackend
from kvpush.engine.native_memory import huge_page_arena, trim_heap
from kvpush.errors import ModelLoadError
from kvpush.layers.linear import pack_linears
from kvpush.models.arch import ArchConfig, load_arch_config
from kvpush.models.decoder import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF projection name -> (fused parameter name, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def resolve_dtype(name: str, cfg: ArchConfig) -> torch.dtype:
    key = cfg.torch_dtype if name == "auto" else name
    key = {"float": "float32", "half": "float16", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(key, key)
    if key not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {key!r}; supported: {sorted(DTYPES)}")
    return DTYPES[key]


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
    else:
        files = [os.path.join(model_dir, "model.safetensors")]
    missing = [p for p in files if not os.path.isfile(p)]
    if missing:
        raise ModelLoadError(f"missing weight file(s): {missing}")
    return files


def load_model(model_dir: str, dtype: str = "auto", device: str = "cpu", max_positions: int | None = None,
               huge_pages: bool = True, linear_backend: LinearBackend = LinearBackend.MKL):
    """Build the model for the checkpoint and load its weights. Returns (model, arch config, dtype).
    With the `onednn` linear backend the linears' weights are packed for oneDNN (layers/linear.py) in
    place of the loaded ones. On the CPU with `huge_pages`, the other weights (all of them with `mkl`)
    end up on transparent huge pages (`pack_on_huge_pages`)."""
    cfg = load_arch_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    with torch.device(device):
        model = CausalLM(cfg, max_positions or cfg.max_position_embeddings)
    _load_weights(model, cfg, safetensors_files(model_dir))
    model = model.to(dtype=torch_dtype).eval()
    if linear_backend is LinearBackend.ONEDNN:
        try:
            pack_linears(model)
        except RuntimeError as e:
            raise ModelLoadError(f"--linear-backend onednn: oneDNN cannot pack this model's {torch_dtype} "
                                 f"weights here: {str(e).strip().splitlines()[0]}") from e
    if huge_pages and torch.device(device).type == "cpu":
        pack_on_huge_pages(model)
    return model, cfg, torch_dtype


def pack_on_huge_pages(model: torch.nn.Module) -> int:
    """Move every contiguous CPU parameter and buffer of `model` into one buffer advised for transparent
    huge pages (native_memory.huge_page_arena), each 64-byte aligned; values are copied unchanged.
    Returns the bytes moved.

    Why: a decode step reads every weight once, and with 4 KiB pages each step walks ~13,500 pages
    of the bench preset's 55 MB; on 2 MiB pages, 27. Measured on the bench preset (compiled, one
    thread, the same process alternating between two engines, `benchmarks/engine_ab.py`): see the
    docs/results/engine.md. Tensors are moved one at a time, so memory peaks at the model's size
    plus its largest tensor, not at twice the model (the heap is trimmed after the moves). A tensor that
    is a view of a larger storage (shares it with others) stays where it is."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]
               if t.device.type == "cpu" and t.is_contiguous() and t.numel()
               and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()}
    sizes = {k: -(-t.numel() * t.element_size() // 64) * 64 for k, t in tensors.items()}
    arena = huge_page_arena(sum(sizes.values()))
    offset = 0
    with torch.no_grad():
        for k, t in tensors.items():
            view = arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
            offset += sizes[k]
    trim_heap()  # the old copies that lived in malloc's heap go back to the OS now, not at the first idle trim
    return offset


def _load_weights(model: CausalLM, cfg: ArchConfig, files: list[str]) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                target = _place(params, cfg, name, f.get_tensor(name))
                if target:
                    loaded.add(target)
    expected = {key for n in params for key in _expected_keys(n, cfg)}
    missing = expected - loaded
    if missing:
        raise ModelLoadError(f"checkpoint lacks weights: {sorted(missing)[:8]}")


def _place(params: dict, cfg: ArchConfig, name: str, tensor: torch.Tensor) -> str | None:
    """Copy one checkpoint tensor into its (possibly fused) parameter; returns the parameter name."""
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    if "rotary_emb" in name:
        return None
    parts = name.rsplit(".", 2)  # [prefix, proj, weight|bias]
    if len(parts) == 3 and parts[1] in _FUSED:
        fused, shard = _FUSED[parts[1]]
        target = f"{parts[0]}.{fused}.{parts[2]}"
        _copy_shard(params, target, shard, parts[1], tensor, cfg)
        return f"{target}#{shard}"
    if name not in params:
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint")
    _check_shape(name, params[name], tensor)
    with torch.no_grad():
        params[name].copy_(tensor)
    return name


def _copy_shard(params: dict, target: str, shard: int, proj: str, tensor: torch.Tensor, cfg: ArchConfig) -> None:
    if target not in params:
        raise ModelLoadError(f"unexpected tensor for {target!r} in checkpoint")
    if proj in ("q_proj", "k_proj", "v_proj"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size] * 2
    start = sum(sizes[:shard])
    dst = params[target].data.narrow(0, start, sizes[shard])
    _check_shape(f"{target}[{proj}]", dst, tensor)
    with torch.no_grad():
        dst.copy_(tensor)


def _expected_keys(name: str, cfg: ArchConfig) -> list[str]:
    if cfg.tie_word_embeddings and name == "lm_head.weight":
        return []
    if ".qkv_proj." in name:
        return [f"{name}#{i}" for i in range(3)]
    if ".gate_up_proj." in name:
        return [f"{name}#{i}" for i in range(2)]
    return [name]


def _check_shape(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
