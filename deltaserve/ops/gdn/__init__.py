"""Gated delta rule ops (prefill: chunked, decode: one recurrent step). Plain-torch reference for now."""

from deltaserve.ops.gdn.reference import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
