"""ResolvedConfig: the figures start-up resolves once, taken from the memory plan (its clamped max_num_seqs,
its dtypes) and the environment (read when it is built, not at each use)."""

from deltaserve.cache.planner import plan
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.graph_sizes import CHUNK_GRAPH_TOKENS
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.resolved_config import ResolvedConfig


def test_resolved_config_follows_the_clamped_plan_and_reads_the_environment_once(monkeypatch):
    cfg = ModelConfig.from_pretrained(CONFIGS_DIR / "qwen3.5-27b")
    flags = EngineConfig(max_model_len=130_193, kv_cache_memory_bytes=17_796_694_016 - 1, max_num_seqs=3,
                         enable_prefix_caching=False, kv_cache_dtype="fp8")
    memory_plan = plan(cfg, flags, device_memory_bytes=150 * 10**9)
    assert memory_plan.error is None and memory_plan.requested_max_num_seqs == 3
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "0")
    resolved = ResolvedConfig.resolve(flags, memory_plan, on_gpu=True)
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")  # too late: resolved already
    assert resolved.chunk_graph_sizes == ()
    assert resolved.max_num_seqs == memory_plan.max_num_seqs
    assert resolved.decode_graph_sizes[-1] == memory_plan.max_num_seqs
    assert (resolved.model_dtype, resolved.kv_cache_dtype) == ("bfloat16", "float8_e4m3fn")
    assert resolved.use_cuda_graphs and not ResolvedConfig.resolve(flags, memory_plan, on_gpu=False).use_cuda_graphs
    assert ResolvedConfig.resolve(flags, memory_plan, on_gpu=True).chunk_graph_sizes == CHUNK_GRAPH_TOKENS
