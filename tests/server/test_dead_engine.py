"""A worker rank that dies takes the engine down: in-flight requests fail, new ones get 503, /health says 503,
and the server is told once (to exit after a while)."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from deltaserve.config import EngineConfig
from deltaserve.sampling import SamplingParams
from deltaserve.server.api_server import build_app, make_state
from deltaserve.server.async_engine import AsyncEngine, EngineDeadError, _Add, _RequestStream
from deltaserve.server.settings import ServerSettings
from deltaserve.worker.executor import RankFailed


class _DyingEngine:
    """Accepts requests; its first step fails as the executor does when a rank died."""

    tokenizer = None
    max_model_len = 64
    model_config = type("Cfg", (), {"vocab_size": 100})()
    memory_plan = None

    def __init__(self):
        self.unfinished = set()
        self.steps = 0

    def add_request(self, request_id, prompt_token_ids, params, group=None):
        self.unfinished.add(request_id)

    def abort_request(self, request_ids):
        self.unfinished -= set([request_ids] if isinstance(request_ids, str) else request_ids)

    def has_unfinished(self):
        return bool(self.unfinished)

    def step(self):
        self.steps += 1
        raise RankFailed("rank 1 (pipeline stage 1, tensor-parallel rank 0) died (exit code -9)\nmore")


class _Loop:
    def call_soon_threadsafe(self, callback, *args):
        callback(*args)


def test_a_dead_rank_fails_requests_and_refuses_new_ones():
    engine = _DyingEngine()
    async_engine = AsyncEngine(engine)
    told = []
    async_engine.on_dead = told.append
    stream = _RequestStream(_Loop())
    async_engine._handle(_Add("r0", [1], SamplingParams(max_tokens=1), stream))
    async_engine._step()
    error = stream.queue.get_nowait()
    assert isinstance(error, EngineDeadError) and "rank 1 (pipeline stage 1" in str(error)
    assert told == ["rank 1 (pipeline stage 1, tensor-parallel rank 0) died (exit code -9)"]
    assert not engine.unfinished  # aborted in the engine too
    later = _RequestStream(_Loop())
    async_engine._handle(_Add("r1", [1], SamplingParams(max_tokens=1), later))
    assert isinstance(later.queue.get_nowait(), EngineDeadError) and engine.steps == 1

    async def generate():
        async for _ in async_engine.generate("r2", [1], SamplingParams(max_tokens=1)):
            pass
    with pytest.raises(EngineDeadError, match="the engine is down: rank 1"):
        asyncio.run(generate())


def test_http_answers_503_once_the_engine_is_down():
    engine = _DyingEngine()
    engine.scheduler = type("S", (), {"max_num_seqs": 4})()
    state = make_state(engine, EngineConfig(), ServerSettings(served_model_names=("demo",)))
    state.engine.dead = "rank 1 (pipeline stage 1, tensor-parallel rank 0) died (exit code -9)"
    with TestClient(build_app(state)) as client:
        assert client.get("/health").status_code == 503
        response = client.post("/v1/completions", json={"model": "demo", "prompt": [1, 2], "max_tokens": 2})
        assert response.status_code == 503
        assert "rank 1" in response.json()["error"]["message"]
