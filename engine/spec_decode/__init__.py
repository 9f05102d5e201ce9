"""Speculative decoding: drafters that propose tokens cheaply and the verifier that keeps the
target model's output exactly what plain decoding would give.

What lives here: the n-gram (prompt lookup) proposer (`ngram.py`), the DeepSeek MTP proposer
(`mtp.py`), acceptance of drafts against the target's samples and exact rejection sampling
(`verifier.py`), the per-sequence draft length (`throttle.py`), and the drafted/accepted
counters (`stats.py`). What does not: scheduling of KV slots
and the verification forward pass (engine/scheduler.py, engine/model_runner.py call in here), and the
sampler's randomness (kernels/random.py, shared so seeded requests stay reproducible).
"""
