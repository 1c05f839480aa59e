"""Verification of draft tokens against the target's logits: the output distribution stays the target's.

Greedy: accept drafts while they equal the target's argmax, then take the target's own token.
Sampling: Leviathan et al.'s rule. Draft token d at position j is accepted with probability
min(1, p_j(d) / q_j(d)); on the first rejection the replacement is drawn from norm(max(0, p_j - q_j)),
and if every draft is accepted a bonus token is drawn from p_{k+1}. For deterministic proposers (n-gram
lookup, greedy drafts) q is one-hot: accept with probability p_j(d), else draw from p_j without d.
p is the distribution the plain sampler draws from: penalties (counting the drafts before each position),
temperature, top-k, top-p.
"""

from __future__ import annotations

import itertools

import torch

from .sampler import SampleRequest, top_k_top_p


def target_logits(logits: torch.Tensor, draft: list[int], req: SampleRequest) -> torch.Tensor:
    """Apply presence/frequency penalties row by row; row j also counts drafts[:j] as output."""
    p = req.params
    if not p.needs_penalties:
        return logits
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=logits.device)
    if req.output_token_ids:
        ids = torch.tensor(req.output_token_ids, device=logits.device)
        counts += torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
    for j, d in enumerate(draft):
        counts[j + 1:, d] += 1
    return logits - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype))


def target_probs(logits: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    p = req.params
    rows = logits.shape[0]
    return top_k_top_p(logits / p.temperature, [p.top_k] * rows, [p.top_p] * rows).softmax(dim=-1)


@torch.no_grad()
def verify(logits: torch.Tensor, draft: list[int], req: SampleRequest, generator: torch.Generator,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """`logits`: the target's fp32 logits at the k draft positions and the one after, [k + 1, vocab].

    Returns the accepted drafts followed by one token of the target's own (1 to k + 1 tokens).
    `draft_probs` [k, vocab] is the distribution each draft was sampled from; None = one-hot.
    """
    k = len(draft)
    assert logits.shape[0] == k + 1
    logits = target_logits(logits.float(), draft, req)
    if req.params.greedy:
        return _accept_greedy(draft, logits.max(dim=-1).indices.tolist())
    probs = target_probs(logits, req)
    gen = req.generator or generator
    u = torch.rand(k, generator=gen, device=gen.device).tolist()
    p_draft = probs[torch.arange(k), torch.tensor(draft)].tolist() if k else []
    q_draft = [1.0] * k if draft_probs is None else draft_probs[torch.arange(k), torch.tensor(draft)].tolist()
    for j, d in enumerate(draft):
        if u[j] * q_draft[j] < p_draft[j]:  # accept with probability min(1, p / q)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[d] = 0.0
        else:
            residual = (probs[j] - draft_probs[j].to(probs.dtype)).clamp_(min=0.0)
        if not residual.sum() > 0:  # p == q up to rounding: any rejection here has probability ~0
            residual = probs[j]
        return draft[:j] + [int(torch.multinomial(residual, 1, generator=gen))]
    return draft + [int(torch.multinomial(probs[k], 1, generator=gen))]


@torch.no_grad()
def verify_batch(logits: torch.Tensor, drafts: list[list[int]], reqs: list[SampleRequest],
                 generator: torch.Generator) -> list[list[int]]:
    """`verify` for several requests whose rows are stacked in `logits` (len(draft) + 1 rows each).

    Plain greedy requests share one argmax (one host sync); the rest go one by one.
    """
    bounds = [0, *itertools.accumulate(len(d) + 1 for d in drafts)]
    assert bounds[-1] == logits.shape[0]
    plain = [j for j, r in enumerate(reqs) if r.params.greedy and not r.params.needs_penalties]
    out: list[list[int]] = [[] for _ in drafts]
    if plain:
        target = logits.max(dim=-1).indices.tolist()  # one argmax over every row: no gather
        for j in plain:
            out[j] = _accept_greedy(drafts[j], target[bounds[j]:bounds[j + 1]])
    for j, req in enumerate(reqs):
        if not out[j]:
            out[j] = verify(logits[bounds[j]:bounds[j + 1]], drafts[j], req, generator)
    return out


def _accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """The drafts while they equal the target's argmax, then the target's own token."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]]
