"""The GDN layer's GPU prefill path copies no activation (a Qwen3.5-27B profile once showed ~5 copies per
layer: strided q/k/v made contiguous by fla's `input_guard`, the gate z made contiguous by the gated norm).

On the CPU the layer runs the GPU entry points in Triton's interpreter (conv_prefill, the gated norm), with a
stand-in for fla's chunked kernel that records what it is given and runs the reference. Every aten op the
layer issues outside those kernels is logged: none may copy, and fla must get contiguous q, k and v (what it
does not get contiguous it copies). The result equals the layer's reference path.
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

if torch.cuda.is_available():
    pytest.skip("the compiled kernels run on the GPU: tests/gpu", allow_module_level=True)
pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402

from deltaserve.layers import gdn as gdn_layer, norm as norm_layer  # noqa: E402
from deltaserve.layers.batch import ForwardBatch  # noqa: E402
from deltaserve.ops import gdn as gdn_ops  # noqa: E402
from deltaserve.ops.conv1d import cuda as conv_kernels  # noqa: E402
from deltaserve.ops.norm import cuda as norm_kernels  # noqa: E402
from tests.model.helpers import assert_paths_agree, gdn_layer_with_random_states, layer_bound  # noqa: E402
from tests.ops.interpreter import patch_interpreter_index  # noqa: E402

patch_interpreter_index()  # the recurrent prefill loops over tokens cu_seqlens[n] .. cu_seqlens[n+1]

COPIES = {"aten.copy_.default", "aten.clone.default", "aten._to_copy.default", "aten.cat.default"}


class OpLog(TorchDispatchMode):
    """Names of the aten ops run while active, except while `paused` (inside kernels and stand-ins)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def pause(self, fn):
        def paused(*args, **kwargs):
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return paused


def test_prefill_path_copies_nothing(ckpt_qwen3_5, monkeypatch):
    cfg, layer, gen = gdn_layer_with_random_states(ckpt_qwen3_5, num_state_slots=4)
    # three sequences: a fresh one, one continuing from its state, one shorter than the conv window
    batch = ForwardBatch.build([0, 6, 0], [9, 5, 2], [[1, 2, 3], [4, 5, 6], [7]], [2, 0, 3], block_size=4)
    projected = F.linear(torch.randn(16, cfg.hidden_size, generator=gen), layer.in_weight)
    pools = layer.conv_state.clone(), layer.ssm_state.clone()
    expected = layer(projected, batch)  # the reference path on CPU tensors
    expected_pools = layer.conv_state.clone(), layer.ssm_state.clone()
    layer.conv_state.copy_(pools[0])
    layer.ssm_state.copy_(pools[1])

    log, given = OpLog(), []

    def chunked_gdn(q, k, v, *args, **kwargs):  # where fla's chunk_gated_delta_rule would run
        given.extend([q, k, v])
        return log.pause(gdn_ops.gdn_prefill)(q, k, v, *args, **kwargs)

    monkeypatch.setattr(gdn_layer, "conv_prefill", conv_kernels.conv_prefill)
    monkeypatch.setattr(gdn_layer, "gdn_prefill", chunked_gdn)
    monkeypatch.setattr(norm_layer, "gated_rms_norm", norm_kernels.gated_rms_norm)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", log.pause(interpreter.GridExecutor.__call__))
    with log:
        out = layer(projected, batch)

    assert len(given) == 3 and all(t.is_contiguous() for t in given)
    assert not COPIES & set(log.ops), sorted(COPIES & set(log.ops))
    bound = partial(layer_bound, cfg, 6 + 5)  # the longest sequence: 6 cached tokens and 5 new
    assert_paths_agree(out, expected, bound, "layer output")
    torch.testing.assert_close(layer.conv_state, expected_pools[0], atol=0, rtol=0)
    assert_paths_agree(layer.ssm_state, expected_pools[1], bound, "recurrent state")


def test_output_norm_warm_up_runs_each_variant_on_forwards_layout(ckpt_qwen3_5, monkeypatch):
    """GPU start-up runs the gated norm once per rows-per-program variant (`warm_up_output_norm`), with x and
    the gate z laid out as `forward` gives them (z a strided view of the projection), so that the variants it
    compiles are the ones serving launches (here in the interpreter)."""
    from deltaserve.ops.linear import reference as linear_reference

    cfg, layer, gen = gdn_layer_with_random_states(ckpt_qwen3_5, num_state_slots=4)
    calls = []

    def recording_norm(x, gate, weight, eps):
        calls.append((x.shape[0], x.stride(), gate.stride()))
        return norm_kernels.gated_rms_norm(x, gate, weight, eps)

    monkeypatch.setattr(norm_layer, "gated_rms_norm", recording_norm)
    monkeypatch.setattr(linear_reference, "gated_rms_norm", recording_norm)
    forward_layout = {}
    for tokens in (1, 7):  # one token: torch gives z's size-1 token dim a contiguous stride (another variant)
        batch = ForwardBatch.build([0], [tokens], [[1, 2]], [1], block_size=4)
        layer(F.linear(torch.randn(tokens, cfg.hidden_size, generator=gen), layer.in_weight), batch)
        forward_layout[tokens > 1] = calls.pop()[1:]
    max_tokens = 512  # two variants of the tiny layer's rows (1 and 512 tokens): the interpreter's time
    counts = norm_kernels.gated_norm_warm_up_token_counts(layer.num_v_heads, layer.v_dim, max_tokens)
    layer.warm_up_output_norm(max_tokens)
    assert [tokens for tokens, _, _ in calls] == counts and len(counts) > 1
    assert all((x, g) == forward_layout[tokens > 1] for tokens, x, g in calls), (forward_layout, calls)
