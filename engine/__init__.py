"""pagedserve's engine: paged KV cache, prefix caching, continuous batching.

Importing this package loads nothing heavy and changes nothing: the names below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm", "GenerationResult": "engine.llm",
    "LLMEngine": "engine.llm_engine", "EngineStats": "engine.llm_engine",
    "RequestOutput": "engine.output_processor",
    "SamplingParams": "engine.sampling_params",
    "EngineConfig": "engine.config", "CacheConfig": "engine.config", "SchedulerConfig": "engine.config",
    "ModelConfig": "engine.config", "make_config": "engine.config",
    "InvalidRequestError": "engine.errors", "ContextLengthExceededError": "engine.errors",
    "ModelLoadError": "engine.errors",
    "StructuredSpec": "engine.structured",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, make_config  # noqa: F401
    from engine.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError  # noqa: F401
    from engine.llm import LLM, GenerationResult  # noqa: F401
    from engine.llm_engine import EngineStats, LLMEngine  # noqa: F401
    from engine.output_processor import RequestOutput  # noqa: F401
    from engine.sampling_params import SamplingParams  # noqa: F401
    from engine.structured import StructuredSpec  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
