"""Engine output streams as (prompt index, delta) pairs, for requests with one or many prompts.

Invariant: whoever stops reading a stream early closes it (`aclose`), and closing a stream
made here closes every engine stream under it; closing an engine stream aborts its request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


async def tag_stream(idx: int, gen: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    """`gen`'s deltas as (idx, delta)."""
    try:
        async for out in gen:
            yield idx, out
    finally:
        await aclose(gen)


async def merge_streams(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several engine streams as (stream index, delta), in arrival order."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out, None, False))
            await queue.put((i, None, None, True))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e, True))
        finally:
            await aclose(gen)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            i, out, err, done = await queue.get()
            if err is not None:
                raise err
            if done:
                live -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_delta(stream: AsyncIterator[tuple[int, Any]]) -> tuple[int, Any] | None:
    """Wait for the first delta, so errors before any output become a proper HTTP status."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None
    except BaseException:
        await aclose(stream)
        raise


async def aclose(gen: Any) -> None:
    """Close an async generator; anything without `aclose` has nothing to release."""
    close = getattr(gen, "aclose", None)
    if close is not None:
        await close()
