"""The engine thread hands a step's outputs to the event loop in one go (server/async_engine.py: _deliver)."""

import asyncio
import threading

from deltaserve.outputs import CompletionOutput, RequestOutput
from deltaserve.sampling import SamplingParams
from deltaserve.server.async_engine import AsyncEngine, _Add, _deliver, _RequestStream


class _CountingLoop:
    """Stands in for an event loop: counts call_soon_threadsafe and runs the callback at once."""

    def __init__(self):
        self.calls = 0

    def call_soon_threadsafe(self, callback, *args):
        self.calls += 1
        callback(*args)


class _SteppingEngine:
    """One step that finishes every request it was given with one token."""

    def __init__(self):
        self.request_ids = []

    def add_request(self, request_id, prompt_token_ids, params, group=None):
        self.request_ids.append(request_id)

    def step(self):
        outputs = [RequestOutput(r, None, [1], [CompletionOutput(0, "x", [7], None, None, "length")], True)
                   for r in self.request_ids]
        self.request_ids = []
        return outputs


def test_a_steps_outputs_wake_the_event_loop_once():
    loop = _CountingLoop()
    engine = AsyncEngine(_SteppingEngine())
    streams = [_RequestStream(loop) for _ in range(64)]
    for index, stream in enumerate(streams):
        engine._handle(_Add(f"r{index}", [1], SamplingParams(max_tokens=1), stream))
    engine._step()
    assert loop.calls == 1  # not one per request
    assert [stream.queue.get_nowait().request_id for stream in streams] == [f"r{i}" for i in range(64)]


def test_items_keep_their_order_across_single_and_batched_hand_overs():
    """An error put alone after a step's outputs arrives after them (one FIFO of callbacks per loop)."""
    async def run():
        stream = _RequestStream(asyncio.get_running_loop())

        def engine_thread():
            _deliver([(stream, "first")])
            stream.put("second")
            _deliver([(stream, "third")])

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        return [await stream.queue.get() for _ in range(3)]

    assert asyncio.run(run()) == ["first", "second", "third"]
