"""A deployment handle's call shape over an object in this process: what `OpenAIServer` calls (`h.m.remote(...)`
awaited, `h.options(stream=True).m.remote(...)` iterated, either cancelled) when the verifier it serves is its own
replica (`ingress.in_verifier`), so that a streamed token reaches the client without a message between replicas."""

from __future__ import annotations

import asyncio
import inspect


class LocalHandle:
    def __init__(self, target, stream: bool = False):
        self._target, self._stream = target, stream

    def options(self, stream: bool = False) -> LocalHandle:
        return LocalHandle(self._target, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, name), self._stream)


class _LocalMethod:
    def __init__(self, fn, stream: bool):
        self.fn, self.stream = fn, stream

    def remote(self, *args, **kwargs):
        """A stream (an async iterator with `cancel`), or an awaitable future (cancelling it cancels the call)."""
        if self.stream:
            return _LocalStream(self.fn(*args, **kwargs))
        out = self.fn(*args, **kwargs)
        if inspect.isawaitable(out):
            return asyncio.ensure_future(out)
        done = asyncio.get_running_loop().create_future()
        done.set_result(out)
        return done


class _LocalStream:
    """An async generator as Serve's streaming response: `cancel` closes it (its `finally` aborts the request)."""

    def __init__(self, gen):
        self.gen = gen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self.gen)

    def cancel(self) -> None:
        asyncio.ensure_future(self.gen.aclose())
