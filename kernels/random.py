"""Counter-based hashed randomness for sampling: noise that is a pure function of its inputs.

`gumbel_noise(seeds, positions, vocab_size)` gives, for each row, Gumbel(0, 1) noise for every
token id, computed by hashing (seed, output position, token id) with SplitMix64. Nothing depends on
the batch, the step or any generator state, so a seeded request samples identically alone or in any
batch, on any device. Sampling policy (temperature, filters) lives in engine/sampler.py.

torch has no unsigned 64-bit arithmetic; int64 multiplication wraps like uint64 (two's complement),
and logical right shifts are emulated by masking the sign-extended bits away.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def as_int64(x: int) -> int:
    """The int64 with the same bit pattern as the uint64 `x` (what int64 tensors can hold)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _lsr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """SplitMix64 finaliser of `x + golden`, elementwise on int64 tensors (bit patterns as uint64)."""
    z = x + as_int64(_GOLDEN)
    z = (z ^ _lsr(z, 30)) * as_int64(_MIX1)
    z = (z ^ _lsr(z, 27)) * as_int64(_MIX2)
    return z ^ _lsr(z, 31)


def splitmix64_int(x: int) -> int:
    """The same hash on a Python int (reference twin, used in tests and for scalars)."""
    m = (1 << 64) - 1
    z = (x + _GOLDEN) & m
    z = ((z ^ (z >> 30)) * _MIX1) & m
    z = ((z ^ (z >> 27)) * _MIX2) & m
    return z ^ (z >> 31)


def row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """One 64-bit key per row from (seed, output position)."""
    return splitmix64(seeds ^ splitmix64(positions))


def token_keys(vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """Per-token hash, [V] int64; callers cache it (it depends on nothing but V)."""
    return splitmix64(torch.arange(vocab_size, dtype=torch.int64, device=device) * 0x2545F491)


def uniform(keys: Tensor, tokens: Tensor) -> Tensor:
    """Uniform (0, 1) float32 per (row key, token key): [N] x [V] -> [N, V]."""
    h = splitmix64(keys[:, None] ^ tokens[None, :])
    # The top 24 bits fill a float32 mantissa exactly; +0.5 keeps u away from 0. It does not keep
    # it away from 1: (2^24 - 1) + 0.5 rounds to 2^24 in float32, so u = 1.0 and the Gumbel noise
    # -log(-log(u)) is +inf, which turns a masked (-inf) logit into NaN and wins the argmax.
    u = (_lsr(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return u.clamp_(max=1.0 - 2.0**-24)


def gumbel_noise(seeds: Tensor, positions: Tensor, tokens: Tensor) -> Tensor:
    """Gumbel(0, 1) noise [N, V] for rows (seed, position) and the token keys `tokens`."""
    u = uniform(row_keys(seeds, positions), tokens)
    return -torch.log(-torch.log(u))
