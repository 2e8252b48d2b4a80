"""The model's linear layers on one of two CPU backends, chosen per machine (engine/linear_choice.py).

`mkl`: plain `nn.Linear` (torch's CPU matmul: MKL's sgemm; on a GPU, cuBLAS), the weights as loaded.
`onednn`: each weight reordered once, at load, into oneDNN's blocked layout (`PackedLinear`) and
multiplied by oneDNN (`mkldnn._linear_pointwise`). The reorder replaces the loaded weight: the model
keeps one copy of its weights either way (a packed weight is not a parameter; it lives in memory
oneDNN allocated, not on the huge-page arena of models/loader.py).

Which is faster depends on the CPU: on an AMD EPYC (Zen 4) the packed linears of the bench preset took
6.7 ms at 16 rows against MKL's 12.7; on an earlier machine packing lost at one and two rows. Hence
the choice at start-up, not a fixed one.

Under torch.compile a packed weight cannot be a graph input: inductor's lowering of
`mkldnn._linear_pointwise` asserts on an opaque oneDNN tensor it did not pack itself (its freezing
pass does that, with a copy of the weights). So a compiled forward calls one opaque op per linear,
`kvpush::onednn_linear(x, bias, residual, handle, out_features)`, and the op finds the packed weight by its
handle in this module's registry (as `kvpush::paged_attention` finds its cache in a context). Eagerly
the module calls oneDNN directly. The op's own cost is in what calibration times (it times the packed
side through the op when the model compiles).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN's batch-size hint for the packed layout (None: its default). Measured on the bench preset's 33
# linears (AMD EPYC Zen 4, one thread, medians of 7): at 1 / 16 / 512 rows, no hint 5.87 / 7.22 / 144 ms,
# hint 16 5.74 / 7.34 / 144, hint 1 6.78 / 13.1 / 159 (as slow as MKL at 16 rows), hint 512 6.19 / 8.38 / 142.
PACK_BATCH_HINT: int | None = None

# An LM head larger than this stays plain: calibration (engine/linear_choice.py) would have to copy it twice to
# time it, and it runs on the sampled rows only.
HEAD_MAX_BYTES = 128 << 20

_packed: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _free_handle() -> int:
    """The smallest handle no live packed weight holds. A compiled graph holds its handles as constants, so
    they are part of inductor's cache key: a model loaded after calibration's packed weights are gone gets
    the handles it gets without calibration, and its graphs come from the same cache entries."""
    return next(h for h in itertools.count() if h not in _packed)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same matrix in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ packed.T + bias (+ residual [..., out], added in the same oneDNN call) -> [..., out]."""
    if x.dim() != 2:
        res = None if residual is None else residual.reshape(-1, residual.shape[-1])
        return onednn_linear(x.reshape(-1, x.shape[-1]), packed, bias, res).view(*x.shape[:-1], -1)
    if residual is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(), packed, bias, "add")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _op(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, handle: int,
        out_features: int) -> torch.Tensor:
    return onednn_linear(x, _packed[handle], bias, residual)


def _op_meta(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, handle: int,
             out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


# The low-level torch.library API, as for kvpush::paged_attention (less Python wrapping per call).
_lib = torch.library.Library("kvpush", "FRAGMENT")
_lib.define("onednn_linear(Tensor x, Tensor? bias, Tensor? residual, int handle, int out_features) -> Tensor")
_lib.impl("onednn_linear", _op, "CPU")
_lib.impl("onednn_linear", _op_meta, "Meta")


class PackedLinear(nn.Module):
    """An nn.Linear whose weight oneDNN holds in its blocked layout (the `onednn` backend)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)  # not a parameter: opaque, and out of .to() / state_dict
        self.bias = linear.bias
        self.handle = _free_handle()
        _packed[self.handle] = self.packed

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + bias (+ residual)."""
        if torch.compiler.is_compiling():
            return torch.ops.kvpush.onednn_linear(x, self.bias, residual, self.handle, self.out_features)
        return onednn_linear(x, self.packed, self.bias, residual)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


def residual_linear(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x): a packed linear adds the residual in its oneDNN call. Under torch.compile that
    keeps the residual stream a materialised output of the opaque op; added outside it, inductor recomputed
    the stream from the embedding in each layer's fused kernels (twice the kernels to compile, and more work
    per step). A plain linear's sum compiles to addmm, as it always did."""
    if isinstance(linear, PackedLinear):
        return linear(x, residual)
    return residual + linear(x)


def packable(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every nn.Linear the `onednn` backend packs, in forward order: all of
    them except one whose weight another module shares (a tied LM head: the embedding reads it too) and an
    LM head (`lm_head`) of more than HEAD_MAX_BYTES."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    for parent in model.modules():
        for name, child in parent.named_children():
            if not isinstance(child, nn.Linear) or counts.get(id(child.weight), 0) != 1:
                continue
            w = child.weight
            if name != "lm_head" or w.numel() * w.element_size() <= HEAD_MAX_BYTES:
                yield parent, name, child


def pack_linears(model: nn.Module) -> int:
    """Replace every packable nn.Linear of `model` by a PackedLinear, one at a time: memory peaks at the
    model plus one weight, and the model keeps one copy of each. Returns how many were packed."""
    done = 0
    for parent, name, linear in list(packable(model)):
        setattr(parent, name, PackedLinear(linear))
        del linear
        done += 1
    return done


def linear_modules(model: nn.Module) -> list[nn.Module]:
    """The model's linear layers, packed or not, in forward order."""
    return [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The `mkl` backend's product, as nn.Linear computes it (calibration times this)."""
    return F.linear(x, weight, bias)
