"""Gated DeltaNet mixer (the linear-attention layer of Qwen3.5 / Qwen3-Next), over the GDN state pool.

Per sequence the layer carries two states, held in pools indexed by the sequence's state slot:
a conv state (the last W-1 pre-conv inputs, [slots, conv_dim, W-1]) and a recurrent state
([slots, HV, K, V], float32 by default). See the architecture reference, section 2.

The decoder layer applies the input projection (`in_weight`, with its norm); `forward` takes its output.
On the GPU, prefill copies no activation: the conv writes q, k and v as three contiguous tensors (fla's
chunked kernels would copy strided views), and the gated norm reads z as a strided view of the projection.
Decode keeps q, k, v as strided views of one conv output, which its kernels read in place.

Under tensor parallelism a rank holds a contiguous block of key heads and the value heads that read them (value
head h reads key head h // (HV / HK)), with their conv channels, A_log, dt_bias and states; the gated norm is per
head (its weight is shared); out_proj is row-parallel, all-reduced by the decoder layer.
"""

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch, MidChunkSaves
from deltaserve.layers.linear import fuse_linears, split_columns
from deltaserve.layers.norm import GatedRMSNorm
from deltaserve.ops.conv1d import conv_decode, conv_prefill
from deltaserve.ops.gdn import gdn_decode, gdn_gates, gdn_prefill
from deltaserve.ops.linear import gated_norm_linear
from deltaserve.worker.distributed import SINGLE, ParallelContext


class GatedDeltaNet(nn.Module):
    # the linears a quantized checkpoint may store quantized (conv1d never is)
    PROJECTIONS = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        H = cfg.hidden_size
        # this rank's heads (all of them at tp_size 1)
        self.num_k_heads = parallel.shard(cfg.gdn_num_k_heads, "linear_num_key_heads")[1]
        self.num_v_heads = parallel.shard(cfg.gdn_num_v_heads, "linear_num_value_heads")[1]
        self.k_dim, self.v_dim = cfg.gdn_k_dim, cfg.gdn_v_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused_inproj = cfg.gdn_fused_inproj
        if self.fused_inproj:  # Qwen3-Next: [q|k|v|z] and [b|a], interleaved per key head
            self.in_proj_qkvz = nn.Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(H, 2 * self.num_v_heads, bias=False)
        else:  # Qwen3.5: separate projections, [q|k|v] flat
            self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)
        self.in_proj_weight: torch.Tensor | None = None  # all input projections' rows, set by fuse()
        # State pools, bound by the runner: [slots, conv_dim, W-1] and [slots, HV, K, V].
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def fuse(self) -> None:
        """After loading: all input projections become one matmul."""
        if self.fused_inproj:
            self.in_proj_weight = fuse_linears(self.in_proj_qkvz, self.in_proj_ba)
        else:
            self.in_proj_weight = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    @property
    def in_weight(self) -> torch.Tensor:
        """All input projections' rows (see `fuse`), applied by the decoder layer together with its norm."""
        return self.in_proj_weight

    def _split_projection(self, proj):
        """proj: [T, conv_dim + value_dim + 2 HV], or those columns as blocks (ops.linear.matmul_blocks) -> qkv
        [T, conv_dim] (pre-conv q|k|v), z [T, HV, dv], b, a [T, HV]: views of proj for Qwen3.5; Qwen3-Next's rows,
        interleaved per key head, are gathered."""
        blocks = proj if isinstance(proj, tuple) else (proj,)
        T, HV = blocks[0].shape[0], self.num_v_heads
        if not self.fused_inproj:  # rows [q|k|v | z | b | a]
            qkv, z, b, a = split_columns(blocks, [2 * self.key_dim + self.value_dim, self.value_dim, HV, HV])
            return qkv, z.view(T, HV, self.v_dim), b, a
        # Qwen3-Next rows: [qkvz interleaved per key head | ba interleaved per key head]
        r = HV // self.num_k_heads  # value heads per key head
        qkvz, ba = split_columns(blocks, [2 * self.key_dim + 2 * self.value_dim, 2 * HV])
        qkvz = qkvz.view(T, self.num_k_heads, 2 * self.k_dim + 2 * r * self.v_dim)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim], dim=-1)
        b, a = ba.reshape(T, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, HV, self.v_dim), b.reshape(T, HV), a.reshape(T, HV)

    def _save_conv_checkpoints(self, qkv: torch.Tensor, saves: MidChunkSaves) -> None:
        """The conv state at each save point is the W-1 inputs before it, rows of this step (a save point is
        at least one block after its chunk's start): copied to the checkpoint slots."""
        width = self.conv1d.weight.shape[-1]
        if saves.min_offset < width - 1:
            raise ValueError(f"a checkpoint inside a step needs {width - 1} of its chunk's tokens before it, got "
                             f"{saves.min_offset} (cache/cache_manager.MID_CHUNK_SAVE_MIN_HEAD)")
        rows = saves.save_rows[:, None] - width + 1 + torch.arange(width - 1, device=qkv.device)  # [P, W-1]
        self._copy_conv_inputs(qkv, rows, saves.checkpoint_slots)

    def _copy_conv_inputs(self, qkv: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Conv states from this step's inputs: rows [P, W-1] of qkv [T, conv_dim] into the pool at slots [P]."""
        window = qkv[rows.reshape(-1)].view(rows.shape[0], rows.shape[1], -1).transpose(1, 2)  # [P, conv_dim, W-1]
        self.conv_state.index_copy_(0, slots, window.to(self.conv_state.dtype))

    def _prefill_with_checkpoints(self, q, k, v, a, b, saves: MidChunkSaves) -> torch.Tensor:
        """gdn_prefill with the recurrent state of some sequences checkpointed inside the chunk: the step runs
        with each saved sequence split at its save point (its tail from zeros, into the checkpoint slot, as a
        placeholder), the working slots' state there is copied to the checkpoint slots, then the tails run
        again from it and their outputs replace the placeholders. Returns o: [T, HV, V]."""
        o = gdn_prefill(q, k, v, a, b, self.ssm_state, saves.split_state_slots, saves.split_has_initial_state,
                        saves.split_cu_seqlens, saves.split_cu_seqlens_cpu, saves.split_max_query_len,
                        A_log=self.A_log, dt_bias=self.dt_bias)
        self.ssm_state.index_copy_(0, saves.checkpoint_slots, self.ssm_state.index_select(0, saves.working_slots))
        rows = saves.tail_rows
        tails = gdn_prefill(q[rows], k[rows], v[rows], a[rows], b[rows], self.ssm_state, saves.working_slots,
                            saves.tail_has_initial_state, saves.tail_cu_seqlens, saves.tail_cu_seqlens_cpu,
                            saves.tail_max_len, A_log=self.A_log, dt_bias=self.dt_bias)
        return o.index_copy_(0, rows, tails)

    def _padded_prefill(self, q, k, v, a, b, batch: ForwardBatch) -> torch.Tensor:
        """gdn_prefill of a padded single-chunk step, every launch of a fixed shape (see PaddedChunk): fla over
        all rows with those from `stop` on masked, the state at `stop` copied to the checkpoint slot, then the
        window's rows [stop, L) again on the recurrent kernel. Returns o: [R, HV, V]."""
        plan = batch.padded
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)  # [R, HV] each
        keep = plan.keep[:, None]
        # zero write strength and log decay: S = exp(0) S + k 0 (v - S^T k) = S, exactly
        g, beta = g * keep, beta * keep
        o = gdn_prefill(q, k, v, g, beta, self.ssm_state, batch.state_slots[:1], batch.has_initial_state[:1],
                        plan.fla_cu_seqlens, plan.fla_cu_seqlens_cpu, chunk_indices=plan.fla_chunk_indices)
        self.ssm_state.index_copy_(0, plan.checkpoint_slot, self.ssm_state.index_select(0, batch.state_slots[:1]))
        rows = plan.window_rows
        redo = gdn_prefill(q[rows], k[rows], v[rows], a[rows], b[rows], self.ssm_state, plan.window_slots,
                           plan.window_has_initial_state, plan.window_cu_seqlens, None, rows.shape[0],
                           A_log=self.A_log, dt_bias=self.dt_bias)  # [B, HV, V]
        o[rows] = torch.where(plan.window_redo[:, None, None], redo, o[rows])
        return o

    def forward(self, projected, batch: ForwardBatch) -> torch.Tensor:
        """projected: [T, conv_dim + value_dim + 2 HV], the output of `in_weight`, or its column blocks
        (ops.linear.matmul_blocks) -> [T, H]. Reads and writes this batch's slots of the conv and recurrent state
        pools."""
        qkv, z, b, a = self._split_projection(projected)
        o = self._conv_and_delta_rule(qkv, a, b, batch)
        # out_proj(norm(o, z)); z: a strided view of the projection (ops/linear fuses the two for batch-1 decode
        # where its tuned table says it pays)
        return gated_norm_linear(o, z, self.norm.weight, self.norm.eps, self.out_proj.weight)

    @torch.no_grad()
    def warm_up_output_norm(self, max_tokens: int) -> None:
        """GPU start-up: run the gated output norm once for each of its kernel variants that steps of up to
        max_tokens tokens launch (it picks rows per program from the row count), on inputs laid out as
        `forward`'s, so that serving compiles none of them; before an FP8 out-projection also the variant that
        writes its activation quantized (gated_norm_linear's, at the row counts whose product takes it)."""
        from deltaserve.ops.norm.cuda import gated_norm_warm_up_token_counts, gated_rms_norm  # GPU only
        from deltaserve.ops.quant_gemm.cuda_fp8 import TORCH_ROW_MULTIPLE

        like = dict(dtype=self.norm.weight.dtype, device=self.norm.weight.device)  # the activations' (the model's)
        counts = gated_norm_warm_up_token_counts(self.num_v_heads, self.v_dim, max_tokens)  # 27B: 1 to 342
        projected = torch.zeros(max(counts), self.in_weight.shape[0], **like)
        takes_quantized = getattr(self.out_proj.weight, "fp8_input_block", None)
        for tokens in counts:
            _, z, _, _ = self._split_projection(projected[:tokens])
            o = torch.zeros(tokens, self.num_v_heads, self.v_dim, **like)
            self.norm(o, z)
            # a row count of this variant whose product may take it quantized (F.scaled_mm: whole multiples only)
            multiple = tokens + -tokens % TORCH_ROW_MULTIPLE
            if takes_quantized is not None and takes_quantized(multiple) == self.v_dim:
                gated_rms_norm(o, z, self.norm.weight, self.norm.eps, quant_block=self.v_dim)

    def _conv_and_delta_rule(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             batch: ForwardBatch) -> torch.Tensor:
        """qkv: [T, conv_dim] pre-conv q|k|v; a, b: [T, HV] raw gate projections -> o: [T, HV, V]."""
        T = qkv.shape[0]
        conv_w = self.conv1d.weight.squeeze(1)  # [conv_dim, W]
        slots = batch.state_slots
        qkv_dims = (self.key_dim, self.key_dim, self.value_dim)
        if batch.is_decode:  # strided views of one [N, conv_dim] output
            q, k, v = conv_decode(qkv, conv_w, self.conv_state, slots).split(qkv_dims, dim=-1)
        else:  # three contiguous [T, d] tensors
            if batch.mid_saves is not None:
                self._save_conv_checkpoints(qkv, batch.mid_saves)
            if batch.padded is not None:  # the conv state at its `stop`: the W-1 inputs before it
                self._copy_conv_inputs(qkv, batch.padded.conv_rows[None], batch.padded.checkpoint_slot)
            q, k, v = conv_prefill(qkv, conv_w, self.conv_state, slots, batch.has_initial_state, batch.cu_seqlens_q,
                                   split=qkv_dims)
        q = q.view(T, self.num_k_heads, self.k_dim)
        k = k.view(T, self.num_k_heads, self.k_dim)
        v = v.view(T, self.num_v_heads, self.v_dim)
        if batch.is_decode:
            return gdn_decode(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state, slots)
        if batch.mid_saves is not None:
            return self._prefill_with_checkpoints(q, k, v, a, b, batch.mid_saves)
        if batch.padded is not None:
            return self._padded_prefill(q, k, v, a, b, batch)
        # raw gates: the GPU's recurrent kernel for short chunks computes them itself
        return gdn_prefill(q, k, v, a, b, self.ssm_state, slots, batch.has_initial_state, batch.cu_seqlens_q,
                           batch.cu_seqlens_cpu, batch.max_query_len, A_log=self.A_log, dt_bias=self.dt_bias)
