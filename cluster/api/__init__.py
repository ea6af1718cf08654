"""The OpenAI-compatible HTTP front and its Ray Serve application.

Request bodies and their validation (`protocol`), prompts and chat templates, response and
SSE shaping, the error mapping, Prometheus metrics, the FastAPI app over any engine client,
the Serve deployments (`serve_app`: the ingress and the `LLMServer` replicas that host an
`AsyncLLMEngine`) and the settings of the process that starts Ray (`serve_env`, `haproxy.sh`).

Invariant: this package may import `cluster.engine`; the engine never imports it.
"""
