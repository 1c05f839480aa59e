"""Speculative decoding: proposers (n-gram lookup, draft model), exact verification, adaptive γ."""

from __future__ import annotations

import torch

from ..config import EngineConfig, ModelConfig
from ..step_cost import StepCostModel
from .proposer import NgramProposer, Proposer
from .speculator import SpecStats, Speculator

__all__ = ["NgramProposer", "Proposer", "Speculator", "SpecStats", "build_speculator"]


def build_speculator(config: EngineConfig, target: ModelConfig, num_blocks: int, max_len: int,
                     device: torch.device, cost: StepCostModel | None = None) -> Speculator | None:
    """The configured speculator, or None for `speculative_method="none"`."""
    if config.speculative_method == "none":
        return None
    if config.speculative_method == "ngram":
        proposer: Proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from .draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, target.vocab_size, num_blocks, max_len, device)
    return Speculator(proposer, config.num_speculative_tokens, cost)
