"""Prefill/decode disaggregation over the shared KV tier: the flow that runs a request on a prefill
worker and resumes it on a decode worker (flow.py), and the worker's internal token-id API it rides
on (protocol.py, client.py over http1.py, errors.py, the hand-off metrics in metrics.py), with the
two helpers both ends of that API share: the JSON codec of the dataclasses crossing a process
(dataclass_json.py) and `BackgroundTask` (background.py).

Not here: which worker serves a request (router/, which the flow reaches through its
`WorkerPicker` protocol); the worker app (server/worker.py). Never imports torch."""
