"""Shared fixtures: the real SmolLM2 weights are loaded once per session and shared by engines."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run interpreted on the CPU; must precede `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A C++ kernel that does not build fails the run (it never turns into skipped tests or a quietly slower path),
# and the dispatch table's timing probes are pinned: the same routes on every run, whatever the machine's load.
os.environ["PAGEDSERVE_REQUIRE_KERNELS"] = "1"
from pagedserve.engine.machine import cpu  # noqa: E402

# The int8 GEMMs (AMX-INT8, VNNI) are off here, so the exact-parity tests hold on every CI CPU; their own tests
# (test_quant.py) turn them on where the CPU has them.
os.environ.setdefault("PAGEDSERVE_KERNEL_POLICY", f"auto_bf16={'on' if cpu().native_bf16 else 'off'},"
                      "prepack_fp32=on,torch_int_bf16=on,quant_gemm_amx=off,quant_gemm_vnni=off")

from pagedserve.engine import LLMEngine, SamplingParams, make_config  # noqa: E402
from pagedserve.engine.config import ModelConfig, bundled_model_path  # noqa: E402
from pagedserve.engine.models.llama import LlamaModel  # noqa: E402
from pagedserve.engine.models.loader import build_model, load_config  # noqa: E402
from pagedserve.engine.tokenizer import load_tokenizer  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x as our quantized GEMVs multiply it: int8 codes with a scale per 32 values (llama.cpp's Q8_0), dequantized,
    in fp32."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # the kernel's fp32 ops, so the same codes, ties included (`127 / amax` would be torch's reciprocal times 127)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    return (torch.round(b * inv) * (amax / 127)).reshape(x.shape)


def _our_gemv(lin, x: torch.Tensor) -> bool:
    route = next(r for r in lin.routes if x.shape[0] <= r.max_rows)
    return route.kernel == f"{getattr(lin.qweight, 'kind', None)} GEMV (ours)"


def quant_reference(lin, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What a quantized Linear should compute for x, up to fp32 summation order: x @ w^T (w: the dequantized
    weight), with x as q8_0(x) where our GEMV serves x's rows, whose bf16 output is then rounded as the kernel's.
    Held to this, a kernel's error is its own, not hidden under the activations' ~0.5 %."""
    if not _our_gemv(lin, x):
        return x.float() @ w.float().t()
    return (q8_0(x) @ w.float().t()).to(x.dtype).float()


def quant_tolerance(lin, x: torch.Tensor, otherwise: float) -> float:
    """The bound on lin(x)'s relative error against quant_reference: in bf16, rows our GEMV serves differ from it
    by fp32 summation order and that one rounding (~3e-4 on every -march build of the kernels); else `otherwise`."""
    return 1e-3 if x.dtype == torch.bfloat16 and _our_gemv(lin, x) else otherwise


@dataclass
class Bundled:
    path: str
    config: ModelConfig
    model: LlamaModel  # fp32, CPU
    tokenizer: object


@pytest.fixture(scope="session")
def cpp_kernels() -> None:
    """The C++ kernels, built or loaded, for modules that call them directly (an engine loads them itself)."""
    from pagedserve.engine import cpu_kernels

    assert cpu_kernels.load()  # a failed build fails, never skips


@pytest.fixture(scope="session")
def smollm() -> Bundled:
    path = bundled_model_path()
    cfg = load_config(path)
    model = build_model(path, cfg, torch.float32, torch.device("cpu"), cfg.max_position_embeddings)
    return Bundled(path, cfg, model, load_tokenizer(path))


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, smollm):
    """A tiny random Llama with the bundled model's tokenizer (and chat template): config, safetensors, tokenizer."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-hf")
    cfg = transformers.LlamaConfig(vocab_size=smollm.config.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    smollm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_engine(smollm):
    """Build an fp32 CPU engine over the shared SmolLM2 weights: make_engine(num_blocks=..., ...).

    Servers whose tests are about HTTP, not about how steps are sized, pass max_step_ms=0: their engine then skips
    the warm-up that fits the step-cost model (a few seconds per server; test_step_cost.py and test_server.py's
    servers keep it)."""

    def make(**kwargs) -> LLMEngine:
        kwargs.setdefault("num_blocks", 256)
        cfg = make_config(model=smollm.path, dtype="float32", device="cpu", **kwargs)
        return LLMEngine(cfg, model=smollm.model, tokenizer=smollm.tokenizer)

    return make


@pytest.fixture(scope="session")
def hf_model(smollm):
    """transformers' own Llama on the same GGUF file: the numerical reference."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm.path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def run_to_completion(engine: LLMEngine, check=None) -> dict[str, dict]:
    """Step until idle; collect tokens, text, logprobs and finish reason per request id."""
    results: dict[str, dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "text": "", "logprobs": []})
            r["tokens"] += out.new_token_ids
            r["text"] += out.text
            r["logprobs"] += out.logprobs
            if out.finished:
                r["finish_reason"] = out.finish_reason
                r["num_cached_tokens"] = out.num_cached_tokens
        if check is not None:
            check(engine)
    return results


def greedy(max_tokens: int, logprobs: int | None = 5, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, logprobs=logprobs)


def compare_greedy(ours: list[int], ref: list[int], our_logprobs, tol: float = 1e-3) -> str:
    """'equal', 'tie' (first divergence is a genuine near-tie in our logits), or raises AssertionError."""
    if ours == ref:
        return "equal"
    i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b) if any(
        a != b for a, b in zip(ours, ref)) else min(len(ours), len(ref))
    assert i < min(len(ours), len(ref)), f"lengths differ: {len(ours)} vs {len(ref)}"
    top = dict(our_logprobs[i].top)
    a, b = ours[i], ref[i]
    assert a in top and b in top, f"position {i}: {a} vs {b}, and {b} is not in our top-{len(top)}"
    gap = abs(top[a] - top[b])
    assert gap <= tol, f"position {i}: tokens {a} vs {b} differ by {gap:.2e} in logit (> {tol})"
    return "tie"


NEAR_TIES: list[str] = []  # every accepted divergence, reported at the end of the run


def record_comparison(where: str, ours, ref, our_logprobs) -> str:
    result = compare_greedy(ours, ref, our_logprobs)
    if result == "tie":
        NEAR_TIES.append(where)
    return result


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"greedy comparisons accepted at a genuine near-tie (<=1e-3): {len(NEAR_TIES)}"
                                + (f" ({', '.join(NEAR_TIES)})" if NEAR_TIES else ""))


EOS = 0  # the end-of-sequence token of the scheduler tests' fake vocabulary


def drive(scheduler, ops, step, min_prompt: int = 1, steps_to_drain: int = 20_000,
          priority=lambda pick: 0) -> tuple[list, set]:
    """Random interleavings for the scheduler's property tests: apply `ops` ((op, length, max_tokens, pick) with
    op add / abort / anything else = one `step()`; an added request's priority is `priority(pick)`), then step
    until idle. Asserts what must hold for any
    interleaving: nothing gets stuck, no block leaks, the block manager's books balance, and every request
    not aborted ends by EOS or at exactly max_tokens. Returns (sequences, ids of the aborted ones)."""
    from pagedserve.engine.sequence import Sequence, SequenceStatus

    bm = scheduler.block_manager
    capacity = bm.num_blocks * bm.block_size
    seqs, aborted = [], set()
    for op, length, max_tokens, pick in ops:
        if op == "add":
            length = max(min_prompt, min(length, capacity - max_tokens))  # the engine rejects what can never fit
            q = Sequence(len(seqs), f"r{len(seqs)}", [1 + (pick + i) % 3 for i in range(length)],
                         SamplingParams(max_tokens=max_tokens, priority=priority(pick)), max_tokens, frozenset({EOS}))
            seqs.append(q)
            scheduler.add(q)
        elif op == "abort" and seqs:
            q = seqs[pick % len(seqs)]
            if scheduler.abort(q.request_id) is not None:
                aborted.add(q.seq_id)
        else:
            step()
    for _ in range(steps_to_drain):
        if not scheduler.has_unfinished():
            break
        step()
    assert not scheduler.has_unfinished(), "a request got stuck"
    assert bm.num_used_blocks == 0
    bm.check_integrity([])
    for q in seqs:
        assert q.is_finished
        if q.seq_id not in aborted:
            assert q.status in (SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_STOPPED)
            assert 1 <= q.num_output_tokens <= q.max_tokens
            if q.status is SequenceStatus.FINISHED_LENGTH:
                assert q.num_output_tokens == q.max_tokens
    return seqs, aborted
