"""A smaller (or quantized, or lower-precision) model of the same tokenizer proposes greedily.

It has its own paged KV cache, block manager and block tables, kept in step with the target: each
request's draft state remembers which tokens its cache holds (the verified ones when it last proposed,
then its own drafts), so after verification it keeps exactly the accepted prefix and recomputes from
there. Preemption of the target does not touch it (token ids never change); finishing releases it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..block_manager import BlockManager
from ..config import EngineConfig, resolve_dtype
from ..model_runner import StepInput, build_runner
from ..models.loader import load_config
from ..models.resolver import resolve_model
from ..sampler import SampleRequest
from ..sampling_params import SamplingParams
from ..sequence import Sequence
from .proposer import Proposer


@dataclass(slots=True)
class _DraftState:
    proxy: Sequence  # the draft's view of the request: its token ids, block table, computed count
    verified: int = 0  # tokens of the request known when it last proposed
    fed: list[int] = field(default_factory=list)  # its own drafts whose K/V it computed after those


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, target_vocab: int, num_blocks: int, max_len: int,
                 device: torch.device) -> None:
        # without a draft model: the target itself (another dtype or quantization, the chapter's self-draft); the
        # target's --revision and --gguf-file name the target's files, not the draft's
        path = (resolve_model(config.draft_model) if config.draft_model
                else resolve_model(config.model, config.revision, config.gguf_file)).path
        cfg = load_config(path)
        if cfg.vocab_size != target_vocab:
            raise ValueError(f"draft model {path} has a vocabulary of {cfg.vocab_size} tokens, the target "
                             f"{target_vocab}: a draft must share the target's tokenizer")
        dtype = resolve_dtype(config.draft_dtype, device, config.kernel_policy)
        # the draft as a config of its own: its files, dtype and quantization (group size and LM head at their
        # defaults, as --draft-quantization has no flags for them), and the target's block count
        draft_config = dataclasses.replace(config, model=path, dtype=str(dtype).removeprefix("torch."),
                                           quantization=config.draft_quantization, quant_group_size=None,
                                           quantize_lm_head=None, cuda_graphs=False,
                                           cache=dataclasses.replace(config.cache, num_blocks=num_blocks))
        self.runner = build_runner(draft_config, path, cfg, device, dtype, max_len)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, enable_prefix_caching=False)
        self._greedy = SampleRequest(SamplingParams(max_tokens=None, temperature=0.0), [], None)
        self._states: dict[int, _DraftState] = {}

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        return self.propose_batch([seq], [max_tokens])[0]

    def propose_batch(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        active: list[tuple[int, _DraftState, int]] = []  # (index, state, drafts wanted)
        for i, (seq, k) in enumerate(zip(seqs, max_tokens)):
            if k > 0:
                st = self._sync(seq)
                need = seq.num_tokens - st.proxy.num_computed_tokens + k - 1
                if self.block_manager.can_allocate(st.proxy, need):
                    self.block_manager.allocate(st.proxy, need)
                    active.append((i, st, k))
        if not active:
            return out
        # round 0 catches each draft cache up with the request (usually 1-2 tokens), later rounds add one
        num_new = [st.proxy.num_tokens - st.proxy.num_computed_tokens for _, st, _ in active]
        for r in range(max(k for _, _, k in active)):
            group = [(a, n) for a, n in zip(active, num_new) if a[2] > r]
            sampled, _, _ = self.runner.run(StepInput([st.proxy for (_, st, _), _ in group], [n for _, n in group],
                                                   [self._greedy] * len(group)))
            for ((i, st, k), n), tok in zip(group, sampled):
                st.proxy.num_computed_tokens += n
                out[i].append(tok)
                if r + 1 < k:  # the last draft is never fed back: its K/V would be wasted
                    st.proxy.token_ids.append(tok)
                    st.fed.append(tok)
            num_new = [1] * len(active)
        return out

    def _sync(self, seq: Sequence) -> _DraftState:
        """Bring the draft's view in line with the verified tokens: keep the accepted prefix of its drafts."""
        st = self._states.get(seq.seq_id)
        if st is None:
            proxy = Sequence(seq.seq_id, seq.request_id, [], seq.params, seq.max_tokens)
            st = self._states[seq.seq_id] = _DraftState(proxy)
        m = 0
        while (m < len(st.fed) and st.verified + m < seq.num_tokens - 1
               and seq.token_ids[st.verified + m] == st.fed[m]):
            m += 1
        computed = min(st.proxy.num_computed_tokens, st.verified + m)
        st.proxy.token_ids = list(seq.token_ids)
        st.proxy.num_computed_tokens = computed
        self.block_manager.free_tail(st.proxy, computed)
        st.verified, st.fed = seq.num_tokens, []
        return st

    def release(self, seq: Sequence) -> None:
        st = self._states.pop(seq.seq_id, None)
        if st is not None:
            self.block_manager.free(st.proxy)
