"""Deciding which draft tokens the target model accepts. Pure tensor functions, no engine state.

Two rules, both exact (the output has the distribution of plain decoding from the target):

- Deterministic drafters (n-gram, greedy MTP) propose a point mass. The target samples every one of
  the k+1 verified positions with its ordinary sampler, whose randomness depends only on (seed,
  output position, token id); a draft is accepted while it equals the target's own sample there.
  The emitted tokens are then exactly the tokens plain decoding would have produced with that seed,
  greedy or not (`accept_matching_prefix`).
- Drafters with a proposal distribution q: accept draft d with probability min(1, p(d)/q(d)); on the
  first rejection, sample from the normalised residual max(0, p - q) (`rejection_sample`). The
  caller supplies the uniforms and Gumbel noise from the counter-based RNG so that seeded requests
  are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.kernels import random as crandom

PAD = -1  # marks missing draft / output entries in padded [B, k] tensors


@dataclass
class VerifyResult:
    output_tokens: torch.Tensor  # [B, k+1] int64: emitted tokens, PAD after the first num_emitted
    num_accepted: torch.Tensor  # [B] int64: accepted drafts (emitted = accepted + 1)

    def emitted(self, row: int) -> list[int]:
        n = int(self.num_accepted[row]) + 1
        return self.output_tokens[row, :n].tolist()


def num_matching(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the target's samples (one sequence, host lists)."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n


def accept_matching_prefix(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> VerifyResult:
    """Longest prefix of each row's drafts equal to the target's samples, plus one target token.

    draft_tokens: [B, k] int64, PAD where a row has fewer drafts. target_tokens: [B, k+1] int64,
    the target's sample at each verified position (position j is sampled given drafts 0..j-1).
    """
    k = draft_tokens.shape[1]
    assert target_tokens.shape == (draft_tokens.shape[0], k + 1)
    matches = (draft_tokens == target_tokens[:, :k]) & (draft_tokens != PAD)
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)
    return VerifyResult(_mask_after(target_tokens, num_accepted + 1), num_accepted)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    uniforms: torch.Tensor,
    gumbel: torch.Tensor,
) -> VerifyResult:
    """Exact speculative sampling for drafts drawn from a distribution q.

    target_probs: [B, k+1, V] p at each verified position; draft_probs: [B, k, V] q; draft_tokens:
    [B, k] (PAD: no draft, which counts as a rejection without a residual: p itself is sampled);
    uniforms: [B, k] in [0, 1) for the accept test; gumbel: [B, k+1, V] standard Gumbel noise for
    the residual (positions < k) or bonus (position k) sample.
    """
    b, k = draft_tokens.shape
    has_draft = draft_tokens != PAD
    safe_draft = draft_tokens.clamp(min=0).unsqueeze(-1)
    p_d = target_probs[:, :k].gather(-1, safe_draft).squeeze(-1)
    q_d = draft_probs.gather(-1, safe_draft).squeeze(-1)
    # u < p/q written as u * q < p so q = 0 (a draft q could not have proposed) never divides.
    accept = has_draft & (uniforms * q_d < p_d)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    residual = (target_probs[:, :k] - draft_probs).clamp(min=0)
    # Rows without a draft fall back to p itself; a zero residual (p == q) cannot be reached.
    residual = torch.where(has_draft.unsqueeze(-1), residual, target_probs[:, :k])
    dists = torch.cat([residual, target_probs[:, k:]], dim=1)
    corrections = _gumbel_argmax(dists, gumbel)  # [B, k+1]

    drafts_padded = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), PAD)], dim=1)
    positions = torch.arange(k + 1, device=draft_tokens.device)
    is_correction = positions.unsqueeze(0) == num_accepted.unsqueeze(1)
    out = torch.where(is_correction, corrections, drafts_padded)
    return VerifyResult(_mask_after(out, num_accepted + 1), num_accepted)


# Salts the accept-test stream apart from the sampler's Gumbel stream at the same position, so the
# accept decision and the residual sample stay independent.
_ACCEPT_SALT = 0x5EC0DEC0FFEE1234


def rejection_sample_seeded(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> VerifyResult:
    """`rejection_sample` with its randomness drawn from the counter-based RNG.

    seeds: [B] int64 per-sequence seeds; positions: [B] int64 output position of the first verified
    row (row j is output position + j). The accept uniform of draft j is keyed by (seed, output
    position, draft token id); the residual/bonus noise by (seed, output position, every token id),
    the same noise the sampler would use there.
    """
    b, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    rows = positions.unsqueeze(1) + torch.arange(k + 1, device=positions.device)  # [B, k+1]
    row_seeds = seeds.unsqueeze(1).expand(b, k + 1)
    tok_keys = crandom.token_keys(vocab, device=target_probs.device)
    gumbel = crandom.gumbel_noise(row_seeds.reshape(-1), rows.reshape(-1), tok_keys)
    accept_keys = crandom.row_keys(
        row_seeds[:, :k].reshape(-1) ^ _ACCEPT_SALT, rows[:, :k].reshape(-1)
    )
    all_uniforms = crandom.uniform(accept_keys, tok_keys)  # [B*k, V]; one column is used
    uniforms = all_uniforms.gather(1, draft_tokens.clamp(min=0).reshape(-1, 1))
    return rejection_sample(
        target_probs, draft_probs, draft_tokens, uniforms.view(b, k), gumbel.view(b, k + 1, vocab)
    )


def _gumbel_argmax(probs: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
    """Sample from unnormalised probs with the Gumbel-max trick (normalising is not needed)."""
    logp = torch.where(probs > 0, probs.log(), torch.full_like(probs, float("-inf")))
    return (logp + gumbel).argmax(dim=-1)


def _mask_after(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    return torch.where(positions < lengths.unsqueeze(1), tokens, torch.full_like(tokens, PAD))
