"""The streamed completion that this directory's tests send as a client would: one greedy
`/v1/completions` request with `stream` and usage, read chunk by chunk over SSE; an error event
fails the test at once."""

from __future__ import annotations

import asyncio
import json

import httpx


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                            started: asyncio.Event | None = None,
                            served_by: dict[str, str] | None = None
                            ) -> tuple[str, int, str | None]:
    """(text, usage.completion_tokens, finish_reason) of `prompt`'s greedy completion;
    `started` is set once three chunks have come, and `served_by[prompt]` is the
    X-Replica-Id of the LLMServer replica that started the stream."""
    body = {"model": "qwen3-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, reason, chunks = "", -1, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        if served_by is not None:
            served_by[prompt] = r.headers.get("x-replica-id", "")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["text"]
                reason = choice["finish_reason"] or reason
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            chunks += 1
            if started is not None and chunks == 3:
                started.set()
    return text, usage, reason
