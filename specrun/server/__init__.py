"""`specrun serve`: an OpenAI-compatible HTTP front end for one loaded target/draft pair.

Modules: `schemas` (request bodies, OpenAI-shaped errors), `jobs` (a request on its way to the
worker and the events it gets back), `prompts` (prompt tokens, cache reuse, room left), `worker`
(the one thread that owns the models and answers requests in arrival order), `responses`
(completion objects, stream chunks, usage and timings), `app` (FastAPI routes, API key, body
limit, error handlers), `serve` (binding, loading, signals). Only `worker` touches the models.
"""
