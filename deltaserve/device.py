"""Device helpers: host -> device copies that never wait for the device, and the device's SM count.

`torch.tensor(data, device="cuda")` copies synchronously: it blocks the host until every kernel queued on
the stream has finished, which would stall async scheduling (the host preparing step k+1 while step k runs).
`to_device` stages the data in pinned memory and queues the copy behind that work instead.
"""

from __future__ import annotations

import functools

import torch


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a list, numpy array or CPU tensor) as a tensor on `device`, copied without blocking the host."""
    host = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    # the caching host allocator keeps the pinned buffer alive until the queued copy has read it
    return host.pin_memory().to(device, non_blocking=True)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a stand-in of 4 for CPU tensors (the Triton interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
