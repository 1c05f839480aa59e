"""Next-token selection for a batch of fp32 logits: penalties, greedy/temperature/top-k/top-p, seeds.

Random rows draw with the Gumbel/exponential trick (argmax p / q, q ~ Exp(1)), which equals
sampling from p. A request with a seed owns a generator, so its draws do not depend on its
neighbours in the batch: same seed, same output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams
from .structured import TokenConstraint, apply_constraints


@dataclass(slots=True)
class SampleRequest:
    params: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator | None  # per-request when seeded
    constraint: TokenConstraint | None = None  # grammar mask, allowed tokens, logit bias


LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> tuple[list[int], list[TokenLogprob | None]]:
        n, vocab = logits.shape
        logits = apply_constraints(logits, [r.constraint for r in reqs])
        penalised = [i for i, r in enumerate(reqs) if r.params.needs_penalties and r.output_token_ids]
        if penalised:
            logits = logits.clone()
            for i in penalised:
                p = reqs[i].params
                ids = torch.tensor(reqs[i].output_token_ids, device=logits.device)
                counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)[:vocab]
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)

        # max(dim).indices: the same first maximal index as argmax, and faster on the CPU (docs/performance.md)
        tokens = logits.max(dim=-1).indices
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            sub = logits[idx] / torch.tensor([reqs[i].params.temperature for i in rand],
                                             device=logits.device)[:, None]
            sub = top_k_top_p(sub, [reqs[i].params.top_k for i in rand], [reqs[i].params.top_p for i in rand])
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            shared = [j for j, i in enumerate(rand) if reqs[i].generator is None]
            if shared:
                noise[shared] = torch.empty(len(shared), vocab, device=logits.device).exponential_(
                    generator=self.generator)
            for j, i in enumerate(rand):
                if reqs[i].generator is not None:
                    noise[j].exponential_(generator=reqs[i].generator)
            tokens[idx] = (probs / noise).max(dim=-1).indices

        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * n
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            # A token masked out (grammar, logit_bias, allowed ids) has logprob -inf, which JSON cannot carry;
            # report it at a finite floor as vLLM's server does.
            lp = logits[want].log_softmax(dim=-1).clamp_(min=LOGPROB_FLOOR)
            k = max(reqs[i].params.logprobs for i in want)
            top_v, top_i = lp.topk(max(k, 1), dim=-1)
            chosen = lp.gather(1, tokens[want][:, None]).squeeze(1).tolist()
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(want):
                kk = reqs[i].params.logprobs
                logprobs[i] = TokenLogprob(token_list[i], chosen[j], list(zip(top_i[j][:kk], top_v[j][:kk])))
        return token_list, logprobs


def top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p); rows with both off pass through."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= torch.tensor(ks, device=logits.device)[:, None],
                                              float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # top-p over what top-k kept: drop a token once the tokens ranked above it hold top_p of the mass. The top token
    # always stays: a top_p under float32's smallest value (~1e-45) rounds to 0, which would drop every token.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(
        (mass_before >= torch.tensor(top_p, device=logits.device)[:, None]) & (rank > 0), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
