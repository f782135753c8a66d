"""Programmatic dependent launch (PDL) for our Triton kernels on Hopper and later GPUs.

A decode step is hundreds of short kernels, and between two of them the GPU waits for the first to complete and
flush its writes before it even begins to launch the second. Launched with PDL (CUDA's programmatic stream
serialization, which CUDA-graph capture keeps), a kernel's launch may begin once every program of the kernel
before it has exited, overlapping that flush; the kernel then waits (`griddepcontrol.wait`) until the previous
kernel has completed and its writes are visible. Every kernel of ours launched so calls
`wait_for_previous_kernel(PDL)` first, in every program, before it reads or writes anything, so the stream's
order holds for all of its memory, and a kernel completes only after the one before it did (so the order is
transitive across kernels).

The gain measured on the H200 is small, within the run-to-run spread; two stronger forms lost: releasing the
next kernel as soon as a program has waited (`griddepcontrol.launch_dependents`: its programs then sit resident,
waiting, beside the running kernel) and, with it, an L2 prefetch of each projection's first weight bytes before
the wait (docs/performance.md, 'Programmatic dependent launch').

Kernels of others (cuBLAS, fla-core, torch) launch as usual: they wait for the whole previous kernel, and a PDL
kernel after one of them waits for it as above. `DELTASERVE_PDL=0` turns PDL off: the kernels then launch as
before, with the wait compiled out. The engine checks PDL once at start-up (`verify`: a launch eagerly and in a
captured graph) and turns it off with a warning where the driver cannot do it.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

ENV_VAR = "DELTASERVE_PDL"

_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}
_override: bool | None = None


@functools.cache  # read once: launch_args runs on every eager kernel launch
def _env_allows() -> bool:
    value = os.environ.get(ENV_VAR, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether our kernels launch on `device` with PDL: a CUDA GPU of compute capability 9.0 or later, unless
    DELTASERVE_PDL=0 (or `set_enabled` says otherwise)."""
    allowed = _env_allows() if _override is None else _override
    if device.type != "cuda":
        return False
    return allowed and _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def set_enabled(flag: bool | None) -> None:
    """Force PDL on (where the GPU has it) or off for launches from now on; None goes back to DELTASERVE_PDL.
    For probes and tests: CUDA graphs captured before keep the launches they captured."""
    global _override
    _override = flag


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for launching one of our kernels on `device`: its PDL constexpr and, where enabled,
    Triton's launch_pdl."""
    return _ON if enabled(device) else _OFF


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """The first statement of every kernel of ours (a no-op unless PDL): wait until the previous kernel on the
    stream has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _add_one_kernel(x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs) + 1.0)


def _launch_eagerly_and_in_a_graph(device: torch.device) -> None:
    """Two PDL launches of a kernel adding one, eagerly and as a captured graph replayed; raises if either
    fails or the sum is wrong."""
    x = torch.zeros(16, device=device)
    _add_one_kernel[(1,)](x, BLOCK=16, **launch_args(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _add_one_kernel[(1,)](x, BLOCK=16, **launch_args(device))
        _add_one_kernel[(1,)](x, BLOCK=16, **launch_args(device))
    graph.replay()
    torch.cuda.synchronize(device)
    if not bool((x == 3.0).all()):
        raise RuntimeError(f"PDL launches added {x.tolist()} instead of 3.0 each")


def verify(device: torch.device) -> bool:
    """Engine start-up: if PDL is on for `device`, launch a PDL kernel eagerly and in a CUDA graph once; where
    that fails (a driver without programmatic launches in graph capture), turn PDL off for this process with a
    warning instead of failing later. Returns whether PDL is on."""
    if not enabled(device):
        return False
    try:
        _launch_eagerly_and_in_a_graph(device)
    except Exception as exc:  # the driver's or Triton's error, whatever its type
        logger.warning("programmatic dependent launch failed its start-up check (%s: %s); our kernels launch "
                       "without it (%s=0 silences this)", type(exc).__name__, exc, ENV_VAR)
        set_enabled(False)
        return False
    return True
