"""pagedserve's engine: paged KV cache, prefix caching, continuous batching."""

from engine import allocator  # noqa: F401  (first: before anything large is allocated)
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, make_config
from engine.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from engine.llm_engine import LLM, GenerationResult, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import StructuredSpec

__all__ = [
    "LLM", "LLMEngine", "RequestOutput", "GenerationResult", "SamplingParams", "EngineConfig", "CacheConfig",
    "SchedulerConfig", "ModelConfig", "make_config", "InvalidRequestError", "ContextLengthExceededError",
    "ModelLoadError", "StructuredSpec",
]
