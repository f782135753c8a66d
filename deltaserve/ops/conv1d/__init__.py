"""Causal depthwise conv1d ops (prefill over varlen sequences, decode update in place). Plain-torch reference
for now."""

from deltaserve.ops.conv1d.reference import causal_conv1d, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update"]
