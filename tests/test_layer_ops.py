"""The C++ layer ops (engine/csrc/layer_ops.cpp) against the PyTorch ops they replace, through the layers that
choose between them (engine/layers/)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.config import ModelConfig
from pagedserve.engine.layers.activation import SiluAndMul
from pagedserve.engine.layers.dispatch import KernelTable
from pagedserve.engine.layers.norm import RMSNorm
from pagedserve.engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("cpp_kernels")
CPU = torch.device("cpu")


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    if dtype == torch.float32:  # accumulation order only
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        return
    # bf16: the fused ops round where the PyTorch path rounds, from fp32 values that differ only in accumulation
    # order, so an output may sit one bf16 step away where that order tips a rounding: rarely. A real slip (a sum
    # that skips an element, a 1 % gain) moves 14-99 % of the outputs at these shapes.
    a, b = a.float(), b.float()
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2.0 ** -126))) - 7)  # bf16's spacing at b
    assert ((a - b).abs() <= step).all()
    assert (a != b).float().mean().item() <= 0.01


def _use(cpp: bool, *layers) -> None:
    for layer in layers:
        layer.select_kernels(KernelTable(cpp=cpp), CPU)


# (hidden, intermediate, head dim): a toy shape whose rows are shorter than a vector, and SmolLM2's, whose
# loops run on full AVX-512 vectors; 300 rows spread over the threads
@pytest.mark.parametrize("shape", [(96, 160, 16), (576, 1536, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40, 300])
def test_norm_rope_silu_match(dtype, rows, shape):
    torch.manual_seed(0)
    hidden, inter, hd = shape
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                      num_layers=1, num_heads=hidden // hd, num_kv_heads=hidden // hd // 3, head_dim=hd,
                      max_position_embeddings=512, rms_norm_eps=1e-5)
    norm = RMSNorm(hidden, cfg.rms_norm_eps).to(dtype)
    norm.weight.data.normal_(0, 0.2)
    rope, act = RotaryEmbedding(cfg, 512), SiluAndMul()
    cos, sin = rope(torch.arange(3, 3 + rows), dtype)
    x = torch.randn(rows, hidden).to(dtype)
    qkv = torch.randn(rows, 10, hd).to(dtype)
    gate_up = torch.randn(rows, 2 * inter).to(dtype)
    h, a = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)

    _use(True, norm, rope, act)
    h2 = h.clone()
    fused = {"norm": norm(x), "rope": rope.rotate(qkv.clone()[:, :8], cos, sin).clone(), "silu": act(gate_up),
             "add_norm": norm.add_and_norm(a, h2)}
    assert fused["add_norm"][1] is h2  # the residual was updated in place
    _use(False, norm, rope, act)
    _close(fused["norm"], norm(x), dtype)
    _close(fused["rope"], rope.rotate(qkv[:, :8], cos, sin), dtype)
    g, u = gate_up.chunk(2, dim=-1)
    _close(fused["silu"], F.silu(g) * u, dtype)
    ref_normed, ref_h = norm.add_and_norm(a, h)
    _close(h2, ref_h, dtype)
    _close(fused["add_norm"][0], ref_normed, dtype)


def test_rope_leaves_v_alone_and_works_on_strided_views():
    torch.manual_seed(1)
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    rope = RotaryEmbedding(cfg, 64)
    _use(True, rope)
    cos, sin = rope(torch.tensor([0, 7, 20]), torch.float32)
    qkv = torch.randn(3, 4, 16)
    before = qkv.clone()
    out = rope.rotate(qkv[:, :3], cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place, through the strided view
    assert torch.equal(qkv[:, 3], before[:, 3])  # v untouched
    assert torch.allclose(out[0], before[0, :3])  # position 0: cos 1, sin 0
    assert not torch.allclose(out[1], before[1, :3])
    # a rotation keeps each (x_i, x_{i+D/2}) pair's length
    pair_len = lambda t: t[..., :8] ** 2 + t[..., 8:] ** 2
    assert torch.allclose(pair_len(out), pair_len(before[:, :3]), atol=1e-5)
