"""The instance's paged KV cache: one contiguous block-major buffer (docs/design.md section 2).

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

`kv[b]` (one block, all layers) and `kv[b, l]` (one block, one layer, K and V) are contiguous, so a
transfer layer can address them by byte offset from `base_ptr`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpush.engine.native_memory import advise_huge_pages
from kvpush.layers.cpu_kernels import RowWriter, row_writer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_bytes(self) -> int:
        """Bytes of kv[b, l]: K and V of one layer of one block."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of kv[b]: one block across all layers."""
        return self.num_layers * self.layer_bytes

    @staticmethod
    def blocks_for_memory(memory_bytes: int, per_block_bytes: int) -> int:
        return max(memory_bytes // per_block_bytes, 1)


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                huge_pages: bool = True) -> torch.Tensor:
    """A zeroed KV buffer. In host memory on huge pages where Linux grants them (transparent huge
    pages on madvise): the engine's attention reads and a transfer's copy (CMA walks the pages of
    both buffers) then touch 512x fewer pages. Measured with `benchmarks/transfer_bw.py --num-kv-heads 3
    --sizes 32,256 --huge-pages off|on` (alternating runs): a 32-block (6 MiB) WRITE until its
    notification reached the target 1,026 / 691 us on 4 KiB pages, 574 / 405 us on huge pages; 256
    blocks 11.7 / 9.8 ms -> 6.2 / 4.3 ms."""
    kv = torch.empty(shape, dtype=dtype, device=device)
    if huge_pages and kv.device.type == "cpu":  # advised before the first touch: the zero fill faults them in
        if not advise_huge_pages(kv.data_ptr(), kv.numel() * kv.element_size()):
            log.debug("no transparent huge pages for the KV cache here: 4 KiB pages")
    return kv.zero_()


class KVCache:
    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.kv = allocate_kv(layout.shape, layout.dtype, device)  # [N, L, 2, bs, kvh, hd]
        # write()'s fast path in host memory: one C call (layers/cpu_kernels.py); None: torch ops
        self.row_writer: RowWriter | None = row_writer() if self.kv.device.type == "cpu" else None

    @property
    def base_ptr(self) -> int:
        return self.kv.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def block_offset(self, block_id: int) -> int:
        return block_id * self.layout.block_bytes

    def block_layer_offset(self, block_id: int, layer: int) -> int:
        return block_id * self.layout.block_bytes + layer * self.layout.layer_bytes

    def slot_rows(self, block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows of the new tokens' K, then V, of layer 0 in the [N * L * 2 * bs, kvh * hd] view of
        the cache. block_ids, offsets: [T] -> [2T]; layer l's rows are these + l * 2 * bs."""
        lay = self.layout
        k_rows = block_ids * (lay.num_layers * 2 * lay.block_size) + offsets
        return torch.cat([k_rows, k_rows + lay.block_size])

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys and values with one row copy. rows: [2T] from slot_rows; k, v: [T, kvh, hd]."""
        lay = self.layout
        if self.row_writer is not None and self.row_writer(self.kv, rows, k, v, layer * 2 * lay.block_size):
            return
        flat = self.kv.view(-1, lay.num_kv_heads * lay.head_dim)  # [N * L * 2 * bs, kvh * hd]
        flat.index_copy_(0, rows + layer * 2 * lay.block_size, torch.cat([k, v]).view(rows.shape[0], -1))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks, contiguous. block_ids: [n] -> k, v: [n * bs, kvh, hd].

        One row copy per block for each of K and V (`kv[:, layer, 0]` keeps each block's rows contiguous).
        """
        shape = (-1, self.layout.num_kv_heads, self.layout.head_dim)
        k = torch.index_select(self.kv[:, layer, 0], 0, block_ids)  # [n, bs, kvh, hd]
        v = torch.index_select(self.kv[:, layer, 1], 0, block_ids)
        return k.view(shape), v.view(shape)
