"""OpenAI-compatible HTTP on the router: /v1/models, /v1/completions, /v1/chat/completions, /health.

The HTTP layer knows nothing of routing: it turns a request body into a GenerateRequest (schema, body), runs the
router's own streaming `generate` (the code path the gRPC service uses) and shapes what comes back as OpenAI JSON
or server-sent events (formats, sse). A client that goes away cancels the generator, which cancels the upstream
call (disconnect). The app wires the routes (app), and serve runs it inside the router's event loop.
"""
