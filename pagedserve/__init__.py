"""pagedserve: a small, fast, readable LLM serving engine.

One name for the project's packages: `pagedserve.engine` (the engine: paged KV cache, continuous batching, the
model and its kernels), `pagedserve.server` (the OpenAI-compatible HTTP server and the `pagedserve` command),
`pagedserve.benchmarks` and `pagedserve.tools` (`pagedserve eval`, `pagedserve plan`). The engine's public
names are here too, imported on first use:

    from pagedserve import LLM, SamplingParams
"""

from __future__ import annotations

from typing import Any

from pagedserve.engine import __all__  # noqa: F401  (the lazy table only: nothing heavy is imported)


def __getattr__(name: str) -> Any:
    import pagedserve.engine

    return getattr(pagedserve.engine, name)
