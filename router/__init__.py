"""Routing over data-parallel workers: the worker pool, policies, health checks, DNS discovery,
KV-event-driven prefix index and retries (`Router`, the prefill/decode flow's `WorkerPicker`), and
`RemoteEngine`, the frontend's engine over the routed workers.

Not here: the prefill/decode flow and the worker RPC (disagg/). Speaks token ids to workers;
never imports torch."""
