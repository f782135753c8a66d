"""The hybrid decoder of Qwen3.5 (dense and MoE) and Qwen3-Next, with transformers' parameter names.

Reference: transformers' `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`. Layers are
chosen by `layer_types`: "linear_attention" -> Gated DeltaNet, "full_attention" -> gated attention. Every
layer is pre-norm: h = h + mixer(norm(h)); h = h + mlp(norm(h)). Activations are flat [T, hidden] over all
sequences of the step; see `ForwardBatch`.

Each norm is applied together with the projection that reads it (`ops.linear.rms_norm_linear`: one kernel
for batch-1 decode on the GPU where the tuned table says it pays, the norm then the matmul elsewhere), so a
mixer's forward takes its input projection's output, and a dense MLP's down projection takes the gate/up
projection's.

Tensor parallelism (`ParallelContext`): each mixer and MLP holds its rank's heads or intermediate slice and ends
in a row-parallel projection whose partial sums the decoder layer all-reduces, once per mixer and once per MLP
block; the embedding and lm_head are split along the vocabulary (logits gathered). At tp_size 1 nothing is
reduced and the model is the plain one.
"""

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.layers.attention import GatedAttention
from deltaserve.layers.batch import ForwardBatch
from deltaserve.layers.embedding import VocabParallelEmbedding
from deltaserve.layers.gdn import GatedDeltaNet
from deltaserve.layers.mlp import SparseMoE, SwiGLU
from deltaserve.layers.quant.weight import plain_parts, quantized_parts
from deltaserve.layers.norm import RMSNorm
from deltaserve.layers.rotary import PartialRotary
from deltaserve.ops.linear import rms_norm_and_linear, rms_norm_linear
from deltaserve.worker.distributed import SINGLE, ParallelContext


def norm_then_project(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      blocks: bool = False):
    """weight @ norm(x + residual): [T, N] (blocks: as ops.linear.matmul_blocks's column blocks), and the new
    residual x + residual (x itself when there is none yet, in the first layer)."""
    if residual is None:
        return rms_norm_linear(x, norm.weight, norm.eps, weight, blocks=blocks), x
    return rms_norm_linear(x, norm.weight, norm.eps, weight, residual, blocks=blocks)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: PartialRotary, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, parallel)
        else:
            self.self_attn = GatedAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                            rotary, cfg.rms_norm_eps, parallel)
        if cfg.moe_layers[layer_idx]:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.norm_topk_prob,
                                 parallel)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, parallel)
        # the mixer's and the MLP's row-parallel outputs are partial sums over the TP ranks
        self.all_reduce = parallel.all_reduce if parallel.tp_size > 1 else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                sample_seqs: torch.Tensor | None = None):
        """h: [T, H] output of the previous layer (residual not yet added). Returns (h, residual), [T, H] each;
        with sample_seqs ([S] int64 sequence indices), only the rows of those sequences' last tokens, [S, H]:
        the mixer still writes every token's K/V or state, but attends and the MLP runs for those rows alone."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        # GDN splits its projection into q|k|v, z, b, a: a SplitWeight's blocks need no copy joining them
        projected, residual = norm_then_project(self.input_layernorm, h, residual, mixer.in_weight,
                                                blocks=self.is_linear)
        if sample_seqs is None:
            x = mixer(projected, batch)
        else:
            rows = batch.logits_indices[sample_seqs]  # [S]
            x = mixer(projected, batch)[rows] if self.is_linear else mixer(projected, batch, sample_seqs)
            residual = residual[rows]
            if x.shape[0] == 0:  # nothing samples: the K/V or state was all this layer had to produce
                return x, residual
        if self.all_reduce is not None:
            x = self.all_reduce(x)
        if isinstance(self.mlp, SwiGLU):
            gate_up, residual = norm_then_project(self.post_attention_layernorm, x, residual, self.mlp.gate_up_weight)
            out = self.mlp.down(gate_up)
        elif (router := self.mlp.input_weight(slot := self.mlp.shared_slot(x))) is not None:
            # the router multiplied in the norm's launch
            x, projected, residual = rms_norm_and_linear(x, self.post_attention_layernorm.weight,
                                                         self.post_attention_layernorm.eps, router, residual)
            out = self.mlp(x, projected, slot)
        else:
            x, residual = self.post_attention_layernorm(x, residual)
            out = self.mlp(x)
        return (out if self.all_reduce is None else self.all_reduce(out)), residual


class TextModel(nn.Module):
    """A pipeline stage's part of the decoder: its layers (`parallel.stage_layers`; `layers[i]` is the model's
    layer `layer_offset + i`), the embedding on the first stage and the final norm on the last."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.embed_tokens = None
        if parallel.is_first_stage:
            self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if parallel.tp_size == 1
                                 else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel))
        # One rotary cos/sin cache shared by every attention layer (non-persistent buffers: not in checkpoints).
        rotary = PartialRotary(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.rotary = rotary
        stage = parallel.stage_layers(cfg.num_layers)
        self.layer_offset = stage.start
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, parallel) for i in stage)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if parallel.is_last_stage else None

    def forward(self, input_ids: torch.Tensor | None, batch: ForwardBatch, sample_seqs: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """input_ids: [T] -> final hidden states [T, H] (after the final norm). With sample_seqs ([S] int64
        sequence indices, maybe none), only the rows of those sequences' last tokens, [S, H]: nothing reads the
        last layer's output at other rows, so its attention and MLP run for these alone (on 27B, 1/16 of a long
        prompt's attention and 1/64 of its matmuls).

        A later pipeline stage starts from the previous stage's `intermediate` (h, residual), [T, H] each, instead
        of input_ids; a stage before the last returns its own (h, residual) for the next, every row kept."""
        if intermediate is None:
            h, residual = self.embed_tokens(input_ids), None
        else:
            h, residual = intermediate
        last = len(self.layers) - 1 if self.parallel.is_last_stage else -1
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, batch, sample_seqs if i == last else None)
        if not self.parallel.is_last_stage:
            return h, residual
        if h.shape[0] == 0:
            return h
        h, _ = self.norm(h, residual)
        return h


class HybridForCausalLM(nn.Module):
    """The causal LM: `forward` gives hidden states, `compute_logits` the logits of chosen rows."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.config, self.parallel = cfg, parallel
        self.model = TextModel(cfg, parallel)
        # on the last stage only, this rank's vocab rows (compute_logits gathers the rest); tied to the embedding
        # when one stage holds both (the loader fills it otherwise)
        self.lm_head = None
        if parallel.is_last_stage:
            self.lm_head = nn.Linear(cfg.hidden_size, parallel.shard(cfg.vocab_size, "vocab_size")[1], bias=False)
        if cfg.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        # All GDN layers' state pools, stacked ([layers, slots, ...]); bound by worker/kv_cache.py
        self.conv_states: torch.Tensor | None = None
        self.ssm_states: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor | None, batch: ForwardBatch, sample_seqs: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.model(input_ids, batch, sample_seqs, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in float32 (every rank's vocab slice gathered)."""
        return self.parallel.all_gather(self.lm_head(hidden)).float()

    def fuse(self) -> None:
        """After the weights are loaded: merge projections that share an input (see layers/linear.py) and prepare
        quantized weights for their kernels (a parent's fuse runs before its children's)."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse"):
                module.fuse()

    def _projections(self) -> list:
        """The weights `ops.linear` multiplies at decode-sized row counts (the mixers' input and output
        projections, the dense MLPs', the MoE blocks' joined in-projections and the shared experts' down
        projections): tensors or quantized weights."""
        candidates = []
        for layer in self.model.layers:
            mixer = layer.linear_attn if layer.is_linear else layer.self_attn
            candidates += [mixer.in_weight, mixer.out_proj.weight if layer.is_linear else mixer.o_proj.weight]
            if isinstance(layer.mlp, SwiGLU):
                candidates += [layer.mlp.gate_up_weight, layer.mlp.down_proj.weight]
            elif layer.mlp.shared_expert is not None:  # the joined router (SparseMoE.fuse), its down projection
                joined = layer.mlp.in_weight if layer.mlp.in_weight is not None else layer.mlp.router_weight
                candidates += [w for w in (joined, layer.mlp.shared_expert.down_proj.weight) if w is not None]
        return candidates

    def projection_weights(self) -> list[torch.Tensor]:
        """One plain-tensor weight of each shape and dtype of `_projections` (bf16 row blocks of a quantized
        projection included), for start-up to warm the skinny GEMM up."""
        weights: dict[tuple, torch.Tensor] = {}
        for weight in (part for candidate in self._projections() for part in plain_parts(candidate)):
            weights.setdefault((tuple(weight.shape), weight.dtype), weight)
        return list(weights.values())

    def quantized_weights(self) -> list:
        """One QuantWeight of each shape and layout of `_projections` (the prepared weight's type, its non-tensor
        fields and which tensors it lacks: group size, zero points, act order), for start-up to warm the
        quantized GEMMs up."""
        weights: dict[tuple, object] = {}
        for weight in (part for candidate in self._projections() for part in quantized_parts(candidate)):
            layout = tuple("tensor" if isinstance(v, torch.Tensor) else v for v in vars(weight.prepared).values())
            weights.setdefault((type(weight.prepared), layout), weight)
        return list(weights.values())

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the model's; every stage holds a layer norm in it)."""
        return self.model.layers[0].input_layernorm.weight.dtype

    @property
    def attention_layers(self) -> list[GatedAttention]:
        return [layer.self_attn for layer in self.model.layers if not layer.is_linear]

    @property
    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]
