"""serve_app/local_handle.py: the handle shape `OpenAIServer` calls, over an object in the same process (the verifier
replica with the server in it): results awaited, streams iterated, and a cancelled call ends the work it started."""

from __future__ import annotations

import asyncio

from serve_app.local_handle import LocalHandle


class _Verifier:
    def __init__(self):
        self.closed, self.cancelled = [], []

    async def generate(self, n: int):
        try:
            for i in range(n):
                await asyncio.sleep(0)
                yield i
        finally:
            self.closed.append(n)  # the loop's generate aborts its request here

    async def complete(self, seconds: float) -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled.append(seconds)
            raise
        return "done"

    def running(self) -> int:
        return 3


def test_calls_stream_and_cancel_as_through_a_handle():
    async def go():
        v = _Verifier()
        h = LocalHandle(v)
        assert await h.running.remote() == 3
        assert await h.complete.remote(0) == "done"
        assert [x async for x in h.options(stream=True).generate.remote(3)] == [0, 1, 2] and v.closed == [3]
        stream = h.options(stream=True).generate.remote(100)
        assert await anext(stream) == 0
        stream.cancel()  # a client that hung up: the generator is closed, its finally runs
        for _ in range(5):
            await asyncio.sleep(0)
        assert v.closed == [3, 100]
        call = h.complete.remote(60)
        await asyncio.sleep(0)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert v.cancelled == [60]

    asyncio.run(go())
