"""``unikv serve``: an OpenAI-compatible HTTP server over the online engine loop
(FastAPI + uvicorn; the ``serve`` extra)."""
