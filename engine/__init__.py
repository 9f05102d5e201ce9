"""The inference engine: scheduler, paged KV block manager, model runner, sampler and models.

It knows nothing of HTTP. Its public face is small: `LLM` for offline use and `AsyncEngine` for the
server (add a request, stream its outputs, abort it, report load).
"""
