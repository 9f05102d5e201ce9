"""The inference engine. It knows nothing of HTTP.

Its public face is small: `LLM` (llm.py) for offline use and `AsyncEngine` (async_engine.py) for the
server, which implements `EngineClient` (contract.py): add a request, stream its outputs, abort it,
report load.

The step loop lives at this folder's root: `llm_engine.py` (one step: schedule, run, sample, emit),
`scheduler.py` (what runs), `block_manager.py` (KV memory and the prefix cache), `model_runner.py`
(how it runs), `sampler.py`, with the types they pass around (`request.py`, `sampling_params.py`,
`outputs.py`, `config.py`, `errors.py`, `admission.py`) and their helpers (`async_scheduling.py`,
`cuda_graphs.py`, `structured.py`, `kv_tiering.py`, `step_isolation.py`, `threads.py`).
Subpackages: `models/` (the networks), `loading/` (checkpoint readers and the model registries),
`testmodels/` (writers of random-weight test checkpoints), `parallel/` (tensor and expert
parallelism), `spec_decode/` (speculative decoding).
"""
