"""The CPU core (cache bookkeeping, the scheduler, requests, the step contract, sampling parameters) imports no
torch: a subprocess whose import of torch raises builds a scheduler and runs steps with a hand-built model
output."""

import subprocess
import sys

CHILD = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"the torch-free core imported {name}")
        return None

sys.meta_path.insert(0, NoTorch())

from deltaserve import SamplingParams
from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.cache_manager import CacheManager
from deltaserve.cache.planner import plan  # noqa: F401 (imported for its imports)
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_pool import StatePool
from deltaserve.engine.scheduler import Scheduler
from deltaserve.request import Request, RequestStatus
from deltaserve.sched_output import ModelOutput

blocks, states = BlockPool(16, 4), StatePool(4, 2)
scheduler = Scheduler(CacheManager(blocks, states, PrefixCache(blocks, states, "m")), 4, 16, 64)
request = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2, seed=3), 2, {99})
request.seed = 3
scheduler.add_request(request)
for token in (7, 8):
    out = scheduler.schedule()
    assert [row.seed for row in out.sequences] == [3]
    scheduler.update_from_output(out, ModelOutput({"a": token}, {}, {}))
assert request.status is RequestStatus.FINISHED_LENGTH and request.output_token_ids == [7, 8]
scheduler.add_request(Request("b", [1, 2], SamplingParams(max_tokens=1), 1, {99}))
assert scheduler.schedule().finished_request_ids == ["a"]  # the runner drops a's generator
assert "torch" not in sys.modules
print("ok")
"""


def test_core_runs_without_torch():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
