"""pagedserve's engine: paged KV cache, prefix caching, continuous batching.

Importing this package loads nothing heavy and changes nothing: the names below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {  # name -> the module under pagedserve.engine that defines it
    "LLM": "llm", "GenerationResult": "llm", "LLMEngine": "llm_engine", "EngineStats": "llm_engine",
    "RequestOutput": "output_processor", "SamplingParams": "sampling_params", "EngineConfig": "config",
    "CacheConfig": "config", "SchedulerConfig": "config", "ModelConfig": "config", "make_config": "config",
    "InvalidRequestError": "errors", "ContextLengthExceededError": "errors", "ModelLoadError": "errors",
    "StructuredSpec": "structured",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, make_config  # noqa: F401
    from .errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError  # noqa: F401
    from .llm import LLM, GenerationResult  # noqa: F401
    from .llm_engine import EngineStats, LLMEngine  # noqa: F401
    from .output_processor import RequestOutput  # noqa: F401
    from .sampling_params import SamplingParams  # noqa: F401
    from .structured import StructuredSpec  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pagedserve.engine.{module}"), name)
