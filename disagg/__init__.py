"""Prefill/decode disaggregation over the shared KV tier, and the worker's internal token-id API.
Never imports torch."""
