"""Shared helpers for model tests: load our model and transformers' on a tiny checkpoint, run with caches."""

import torch
import transformers

from tests.tolerance import assert_within, both_sides, stack_bound

from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.worker.kv_cache import CacheShape, bind_caches

BLOCK_SIZE = 4  # small and odd-fitting on purpose: most sequences span several partial blocks
GDN_CHUNK = 64  # tokens per chunk of the chunked gated delta rule (ops/gdn/reference.py's default)


class Reference:
    """transformers' model in float64: its logits are the truth."""

    def __init__(self, path):
        self.fp64 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        self.fp64.config._experts_implementation = "eager"  # the grouped-mm expert kernel has no float64

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Float64 logits [len(ids), V]."""
        with torch.no_grad():
            return self.fp64(torch.tensor([ids])).logits[0]


def load_pair(path):
    """(our float32 model on the CPU with its pools bound, the transformers Reference)."""
    cfg = ModelConfig.from_pretrained(path)
    ours = load_model(path, cfg, torch.float32, "cpu")
    bind_caches(ours, CacheShape(num_blocks=128, block_size=BLOCK_SIZE, num_state_slots=8,
                                 kv_dtype=torch.float32, ssm_dtype=torch.float32), "cpu")
    return ours, Reference(path)


class SequenceRunner:
    """Feeds sequences to our model step by step, each with its own blocks and state slot."""

    def __init__(self, model):
        self.model = model
        self.next_block = 1  # block 0 is the null block
        self.seqs: dict[int, dict] = {}

    def add(self, slot: int) -> None:
        self.seqs[slot] = {"computed": 0, "blocks": []}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one forward with `chunks[slot]` new tokens per sequence; returns logits [len, V] per slot."""
        computed, qlens, blocks, slots, ids = [], [], [], [], []
        for slot, tokens in chunks.items():
            seq = self.seqs[slot]
            need = -(-(seq["computed"] + len(tokens)) // BLOCK_SIZE)
            while len(seq["blocks"]) < need:
                seq["blocks"].append(self.next_block)
                self.next_block += 1
            computed.append(seq["computed"])
            qlens.append(len(tokens))
            blocks.append(list(seq["blocks"]))
            slots.append(slot)
            ids.extend(tokens)
        batch = ForwardBatch.build(computed, qlens, blocks, slots, BLOCK_SIZE)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(torch.tensor(ids), batch))
        out, start = {}, 0
        for slot, qlen in zip(slots, qlens):
            out[slot] = logits[start:start + qlen]
            start += qlen
            self.seqs[slot]["computed"] += qlen
        return out


def gdn_layer_with_random_states(path, num_state_slots: int, seed: int = 0):
    """The first GDN layer of the float32 model at `path` on the CPU, its pools bound with num_state_slots slots
    and filled with random states. Returns (config, layer, generator for further inputs)."""
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, torch.float32, "cpu")
    bind_caches(model, CacheShape(num_blocks=16, block_size=BLOCK_SIZE, num_state_slots=num_state_slots,
                                  kv_dtype=torch.float32, ssm_dtype=torch.float32), "cpu")
    layer = model.gdn_layers[0]
    gen = torch.Generator().manual_seed(seed)
    layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=gen))
    layer.ssm_state.copy_(0.1 * torch.randn(layer.ssm_state.shape, generator=gen))
    return cfg, layer, gen


def cache_tensors(model) -> list[torch.Tensor]:
    """Every tensor a step writes besides its outputs: KV caches and the stacked GDN pools."""
    kv = [t for layer in model.attention_layers for t in (layer.k_cache, layer.v_cache)]
    return kv + [model.conv_states, model.ssm_states]


def layer_chain(cfg: ModelConfig, seq_len: int) -> int:
    """The longest chain of dependent roundings a hidden value goes through in one layer of cfg, for sequences
    of up to seq_len tokens: tests.tolerance.stack_bound's reduction_per_layer.

    in-projection (hidden) + mixer + out-projection (its width) + MLP up (hidden) and down (intermediate, plus
    the sum over the chosen experts and the shared one). The attention mixer reduces over head_dim then over
    the keys; the GDN mixer is its conv plus a recurrence, token by token (seq_len steps of a key-dim reduction)
    or chunked (a chain of key dim + 2 chunk per chunk), whichever is longer (tests.tolerance.recurrence_bound).
    """
    attention = cfg.head_dim + seq_len
    gdn = cfg.conv_kernel + max(seq_len * cfg.gdn_k_dim, -(-seq_len // GDN_CHUNK) * (cfg.gdn_k_dim + 2 * GDN_CHUNK))
    out_width = max(cfg.num_heads * cfg.head_dim, cfg.gdn_num_v_heads * cfg.gdn_v_dim)
    down = max(cfg.intermediate_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size)
    return cfg.hidden_size + max(attention, gdn) + out_width + cfg.hidden_size + down + cfg.num_experts_per_tok + 1


def model_bound(cfg: ModelConfig, seq_len: int, magnitude: float) -> float:
    """Bound on |float32 result - exact| of anything the float32 model cfg computes over up to seq_len tokens
    (logits, a layer's KV or GDN state): the stack of num_layers layers plus the LM head (one more hidden-size
    reduction), relative to the result's own magnitude (tests/tolerance.py's stack_bound)."""
    return stack_bound(layer_chain(cfg, seq_len), cfg.num_layers + 1, magnitude, torch.float32)


def layer_bound(cfg: ModelConfig, seq_len: int, magnitude: float) -> float:
    """model_bound for one layer of cfg (its output, or the state it writes) rather than the whole stack."""
    return stack_bound(layer_chain(cfg, seq_len), 1, magnitude, torch.float32)


def assert_paths_agree(got: torch.Tensor, want: torch.Tensor, bound, what: str) -> None:
    """Two float32 evaluations of one exact value (an engine path and the plain one): each side carries its
    own rounding, so they may differ by twice `bound(magnitude)`, magnitude the plain side's largest element."""
    assert_within(got, want, both_sides(bound(want.abs().max().item()), bound(want.abs().max().item())), what)
