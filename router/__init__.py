"""Routing over data-parallel workers: the worker pool, policies, health checks and retries.
Speaks token ids to workers; never imports torch."""
