"""Where an instance computes and keeps its KV cache: `cpu`, `cuda` or `cuda:N`.

`resolve_device` turns the `--device` string into a torch.device and fails early, with a message
that says what is missing, when CUDA is asked for on a machine without it. The KV buffer then lives
on that device, and NIXL registers it as DRAM (cpu) or VRAM (cuda, with its device id).
"""

from __future__ import annotations

import torch

from kvpush.errors import DeviceError


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda`, `cuda:N` -> torch.device (`cuda` is `cuda:0`, the first visible GPU).

    Creates no CUDA context (so the HTTP front end can check the flag before it spawns the engine).

    DeviceError if the name is malformed, not cpu/cuda, or the GPU is not there.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise DeviceError(f"--device {name!r} is not a device name (use cpu, cuda or cuda:N)") from e
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"--device {name!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {name!r} asks for a GPU but no CUDA device is available (torch "
                          f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'})")
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        raise DeviceError(f"--device {name!r}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on the device's current stream has run (no-op on cpu)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
