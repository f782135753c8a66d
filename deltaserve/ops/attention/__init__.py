"""Paged KV-cache attention ops (cache write, causal attention over block tables). Plain-torch reference for
now."""

from deltaserve.ops.attention.reference import paged_attention, write_kv_cache

__all__ = ["paged_attention", "write_kv_cache"]
