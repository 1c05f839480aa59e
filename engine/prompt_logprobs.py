"""Log-probabilities of the prompt's own tokens (what lm-evaluation-harness's loglikelihood asks for).

Position p's logits score token p + 1, so a chunk of positions [start, stop) yields the entries for
tokens start + 1 .. stop; the first prompt token has none (OpenAI and vLLM return null for it). Each
chunk is computed from the same hidden states the step already made, so chunked prefill changes nothing;
prefix-cache hits would skip positions, so the scheduler does not look up the cache for these requests
(as vLLM does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sampler import TokenLogprob

ROWS_PER_SLICE = 256  # bounds the fp32 [rows, vocab] logits held at once


def prompt_logprobs(logits: Callable[[int, int], torch.Tensor], n: int, targets: list[int],
                    k: int) -> list[TokenLogprob]:
    """`logits(lo, hi)`: fp32 logits at positions p+lo..p+hi-1 of n; targets = the tokens at p+1..p+n. Chosen
    logprob + top k each."""
    out: list[TokenLogprob] = []
    for lo in range(0, n, ROWS_PER_SLICE):
        lp = logits(lo, min(lo + ROWS_PER_SLICE, n)).log_softmax(dim=-1)
        tgt = torch.tensor(targets[lo:lo + ROWS_PER_SLICE], device=lp.device)
        chosen = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
        if k > 0:
            top_v, top_i = lp.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
        else:
            tops = [[] for _ in chosen]
        out += [TokenLogprob(t, c, top) for t, c, top in zip(tgt.tolist(), chosen, tops)]
    return out
