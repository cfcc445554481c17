"""`specrun serve`: an OpenAI-compatible HTTP front end for one loaded target/draft pair.

Modules: `schemas` (request bodies, OpenAI-shaped errors), `jobs` (a request on its way to the
worker and the events it gets back), `prompts` (what a prompt may hold, the room left to generate), `worker`
(the one thread that owns the models; it answers requests in arrival order, several at once
with --parallel), `responses`
(completion objects, stream chunks, usage and timings), `app` (FastAPI routes, API key, body
limit, error handlers), `serve` (binding, loading, signals). Only `worker` touches the models.
"""
