"""Shared fixtures: the demo tokenizer and tiny random checkpoints, each built once per test session.

    tokenizer          the demo byte-level BPE tokenizer with its chat template
    make_checkpoint    arch (+ build_checkpoint's options) -> Path, cached for the session
    ckpt_qwen3_5, ckpt_qwen3_5_moe, ckpt_qwen3_next    float32 checkpoints, seed 0
    tiny_checkpoint    parametrized over every arch in TINY_CONFIGS (the tied variant included)
"""

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deltaserve.demo import TINY_CONFIGS, build_checkpoint, build_tokenizer

# Under pytest-xdist each worker process takes its share of torch's threads (a thread per core): a worker per core
# each running them all oversubscribes the cores, and idle threads spinning for their next op stall the busy ones.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """A function (arch, seed=0, dtype=float32, max_shard_size=None) -> Path that builds each variant once."""
    built = {}

    def checkpoint_for(arch="qwen3_5", seed=0, dtype=torch.float32, max_shard_size=None):
        key = (arch, seed, dtype, max_shard_size)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"ckpt-{arch}")
            built[key] = build_checkpoint(folder, arch, seed=seed, dtype=dtype, max_shard_size=max_shard_size)
        return built[key]

    return checkpoint_for


@pytest.fixture(scope="session")
def ckpt_qwen3_5(make_checkpoint):
    return make_checkpoint("qwen3_5")


@pytest.fixture(scope="session")
def ckpt_qwen3_5_moe(make_checkpoint):
    return make_checkpoint("qwen3_5_moe")


@pytest.fixture(scope="session")
def ckpt_qwen3_next(make_checkpoint):
    return make_checkpoint("qwen3_next")


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_checkpoint(request, make_checkpoint):
    return make_checkpoint(request.param)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread: with two, a busy 2-core machine stalls every op in thread sync.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
