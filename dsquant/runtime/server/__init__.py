"""`dsquant serve`: an OpenAI-compatible HTTP server over the runtime engine (needs the `serve` extra)."""
