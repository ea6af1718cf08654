"""The engine: everything that turns requests into tokens and text, with no HTTP in it.

One model replica's `LLMEngine` (scheduler + KV cache manager + executor + output processor),
its asyncio service `AsyncLLMEngine`, the executors that run a step on the tensor-parallel
workers (in this process, or as Ray actors that park when idle), the offline `LLM`, the engine
configuration, metrics, detokenizers, structured outputs, and the reasoning and tool-call
parsers whose names the configuration accepts.

Invariant: nothing here imports `cluster.api` (nor FastAPI or Ray Serve); the API package
builds on this one, never the other way round (tests/test_import_rules.py).
"""
