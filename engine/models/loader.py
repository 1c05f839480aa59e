"""Where weights come from: a GGUF file, a Hugging Face model directory, or random init at a real shape.

Every source yields (ModelConfig, iterator of HF-named tensors); `LlamaModel.load_weights` does the rest.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import allocator
from ..config import ARCHITECTURES, ModelConfig
from ..errors import ModelLoadError
from ..layers.dispatch import KernelTable, kernel_table
from ..layers.linear import Linear, select_kernels
from ..quant import loading as quant_loading
from ..quant.gguf_blocks import GGUFBlocks
from ..quant.loading import QuantSpec
from ..quant.weight import QuantWeight
from .gguf_file import GGUFFile
from .llama import LlamaModel

if TYPE_CHECKING:
    from ..parallel.group import TensorParallel

logger = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # GGUF tensor types that are not blocks

# Published shapes, for speed tests with random weights ("random:<name>").
RANDOM_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, eos_token_ids=(2,)),
    "qwen2.5-0.5b": dict(architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=True,
                         eos_token_ids=(151645, 151643)),
    "qwen3-0.6b": dict(architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, qk_norm=True,
                       eos_token_ids=(151645, 151643)),
    "llama-3.2-1b": dict(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192),
                         eos_token_ids=(128001, 128008, 128009)),
    # a few-layer model for fast tests of the whole engine
    "tiny": dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5),
}

# GGUF tensor name -> HF name: the top-level tensors, and per layer blk.N.<part>.weight (q, k and v also .bias)
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def model_source(path: str) -> str:
    """'random', 'gguf' or 'hf'; raises ModelLoadError for anything else."""
    if path.startswith("random:"):
        if path.removeprefix("random:") not in RANDOM_SHAPES:
            raise ModelLoadError(f"unknown random shape {path!r}; known: {', '.join(RANDOM_SHAPES)}")
        return "random"
    if path.endswith(".gguf") and os.path.isfile(path):
        return "gguf"
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise ModelLoadError(
        f"model path {path!r} is not a .gguf file, a model directory with config.json, or random:<shape>"
    )


def load_config(path: str) -> ModelConfig:
    kind = model_source(path)
    if kind == "random":
        return ModelConfig(**RANDOM_SHAPES[path.removeprefix("random:")])
    if kind == "gguf":
        return _gguf_config(_gguf_reader(path))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):  # chat models often list extra EOS ids here
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            cfg = {**cfg, "eos_token_id": gen_eos}
    return ModelConfig.from_hf(cfg)


def build_model(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, seed: int = 0, quant: QuantSpec | None = None,
                table: KernelTable | None = None, tp: TensorParallel | None = None) -> LlamaModel:
    """Materialize the model on `device` and fix its kernels (`table`: the dispatch table, default this machine's).
    `quant`: quantize projections (and LM head/embeddings) on load; see engine/quant/loading.py. `tp`: keep only
    this tensor-parallel rank's shard (each rank reads the whole checkpoint, a GGUF memory-mapped, and slices every
    tensor as it streams past; quantized formats are quantized whole, then sliced along their groups, so a shard
    holds exactly the values of the unsplit model)."""
    table = table or kernel_table(device, dtype)
    kind = model_source(path)
    start, resident = time.perf_counter(), resident_bytes()
    quantized = gguf_quantized_names(path) if kind == "gguf" else set()
    if quant is not None and quant.format == "auto" and not quantized:
        quant = None  # auto on float weights: dense
    with torch.device("meta"):  # no throw-away default init: every parameter is written below
        model = LlamaModel(cfg, max_positions, tp).to(dtype)
    if quant is not None and kind != "random":  # before allocation: no dense copy of those weights
        quant_loading.prepare_modules(model, quant, quantized if quant.format == "auto" else None)
    model.to_empty(device=device)
    model.tie_weights()
    model.rope.build()  # the cos/sin table stays fp32
    if kind == "random":
        model.init_random(seed)
        if quant is not None:
            quant_loading.quantize_model(model, quant)
    else:
        weights = checkpoint_tensors(path, cfg, raw=quant is not None)
        if quant is not None:
            group = quant_loading.resolve_group_size(quant, model, gguf_has_q4(path),
                                                     1 if tp is None else tp.size)
            weights = quant_loading.quantized_stream(model, weights, quant, group, dtype, device, table)
        model.load_weights(weights)
    model.eval().requires_grad_(False)
    _gguf_reader.cache_clear()  # its memory map: every tensor has been copied out, so its pages need not stay resident
    select_kernels(model, table, device, dtype)
    sizes = weight_bytes(model)
    logger.info("weights: %s (%.1f MiB in all); projections: %s", ", ".join(
        f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()), sum(sizes.values()) / 2**20,
        model.layers[0].self_attn.qkv_proj.describe_routes())
    allocator.release_freed()
    logger.info("model loaded in %.1f s, resident memory %+.0f MiB", time.perf_counter() - start,
                (resident_bytes() - resident) / 2**20)
    return model


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def checkpoint_tensors(path: str, cfg: ModelConfig, raw: bool = False) -> Iterator[tuple[str, object]]:
    """A GGUF file's or HF directory's tensors under Hugging Face names; with `raw`, a GGUF's block-quantized
    matrices come as their blocks (GGUFBlocks), for quantized storage without a dense round trip."""
    if model_source(path) == "gguf":
        return _gguf_weights(path, cfg, raw)
    return _safetensors_weights(path)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Resident weight bytes per storage format ("bfloat16", "float32", "int8", ...), shared tensors once."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for m in model.modules():
        qw = getattr(m, "qweight", None)
        if isinstance(qw, QuantWeight) and id(qw) not in seen:
            seen.add(id(qw))
            out[qw.format] = out.get(qw.format, 0) + qw.nbytes
    # parameters() yields a tied tensor once; an emptied row-major weight (prepacked only) holds nothing
    for p in list(model.parameters()) + [m.packed for m in model.modules() if isinstance(m, Linear)]:
        if p is not None and p.numel() > 0:
            key = str(p.dtype).removeprefix("torch.")
            out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


# ---- GGUF --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str) -> GGUFFile:
    """Read once for a model build: its config and its weights both need it."""
    try:
        return GGUFFile(path)
    except Exception as e:  # a truncated or foreign file
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e


def _gguf_config(reader: GGUFFile) -> ModelConfig:
    field = reader.fields.get
    arch = field("general.architecture")
    supported = sorted(set(ARCHITECTURES.values()))  # llama.cpp writes Mistral models as llama
    if arch not in supported:
        raise ModelLoadError(f"unsupported architecture {arch!r} in GGUF file; supported: {', '.join(supported)}")
    g = lambda key, default=None: field(f"{arch}.{key}", default)
    num_heads = g("attention.head_count")
    hidden = g("embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(field("tokenizer.ggml.tokens", []))
    scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": g("rope.scaling.type"), "factor": g("rope.scaling.factor"),
                   "original_max_position_embeddings": g("rope.scaling.original_context_length")}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.x: llama3 RoPE scaling baked into per-frequency divisors
        scaling = {"rope_type": "freq_factors",
                   "factors": [float(x) for x in np.asarray(freqs.data, dtype=np.float32).reshape(-1)]}
    eos = field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"),
        num_heads=num_heads,
        num_kv_heads=g("attention.head_count_kv", num_heads),
        head_dim=g("attention.key_length", hidden // num_heads),
        max_position_embeddings=g("context_length", 2048),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3",
        eos_token_ids=(eos,) if eos is not None else (),
    )


def _unpermute_llama(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows interleaved for its RoPE; undo that for rotate-half RoPE."""
    head_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, head_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_has_q4(path: str) -> bool:
    return model_source(path) == "gguf" and any(t.tensor_type.name in ("Q4_0", "Q4_1")
                                                for t in _gguf_reader(path).tensors)


def _block_quantized(t) -> bool:
    return t.tensor_type.name not in FLOAT_TYPES and len(t.shape) == 2


def _hf_name(gguf_name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m[2] in _GGUF_LAYER and (m[3] == "weight" or m[2] in ("attn_q", "attn_k", "attn_v")):
        return f"model.layers.{m[1]}.{_GGUF_LAYER[m[2]]}.{m[3]}"
    if gguf_name in _GGUF_TOP:
        return _GGUF_TOP[gguf_name]
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def gguf_quantized_names(path: str) -> set[str]:
    """HF names (without "model.") of the GGUF's block-quantized matrices."""
    return {_hf_name(t.name).removeprefix("model.") for t in _gguf_reader(path).tensors
            if t.name != "rope_freqs.weight" and _block_quantized(t)}


def _gguf_weights(path: str, cfg: ModelConfig, raw: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors; with `raw`, block-quantized matrices come as their blocks (GGUFBlocks)."""
    import gguf

    reader = _gguf_reader(path)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # read into the config's RoPE scaling, not a parameter
            continue
        name = _hf_name(t.name)
        permuted = cfg.architecture == "llama" and (".attn_q." in t.name or ".attn_k." in t.name)
        heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
        if raw and _block_quantized(t):
            rows = np.arange(t.shape[1])
            blocks = t.data[_unpermute_llama(rows, heads) if permuted else rows]
            yield name, GGUFBlocks(t.tensor_type.name, blocks, t.shape[::-1])
            continue
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        data = np.array(data, dtype=np.float32).reshape(t.shape[::-1])
        yield name, torch.from_numpy(_unpermute_llama(data, heads) if permuted else data)


# ---- Hugging Face directory ----------------------------------------------------------------------
def _safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path!r}")
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
