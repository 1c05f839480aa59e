"""Weight formats: quantize -> packed storage -> dequantize, and a matmul that picks its kernel by M.

Every format stores rows (output features) independently, so fused projections are row concatenations
and llama.cpp's q/k row permutation applies to codes and scales alike.

| format        | storage                                 | bits/weight        | CPU kernel                       |
|---------------|-----------------------------------------|--------------------|----------------------------------|
| `int8`        | int8 [N, K], fp16 scale per row         | 8 + 16/K           | ours: GEMV (M <= 64), tiled GEMM |
| `int8-tensor` | int8 [N, K], one scale                  | 8                  | as int8                          |
| `int4`        | 4-bit codes, fp16 scale per group of g  | 4 + 16/g           | ours: GEMV (M <= 64), tiled GEMM |
| `int4-tensor` | 4-bit codes, one scale                  | 4                  | as int4                          |
| `nf4`         | 4-bit NF4 level index, fp16 absmax / 64 | 4.25               | dequantize + GEMM                |

"Ours" is engine/csrc/quant_linear.cpp (built by engine.cpu_kernels); where it cannot be built, torch's
`_weight_int8pack_mm` (M <= 8) and `_weight_int4pack_mm_for_cpu` (every M, its own machine-specific layout,
see `Int4Weight`) take over, and large M for int8 dequantizes then runs a dense GEMM. CUDA always does that.

torch's packed CPU kernels are fast with bf16 activations and 5-25x slower with fp32 ones on the AVX-512
CPUs we measured (their fp32 path is not vectorised the same way), so `packed_kernel_dtype` times both
once per process and the kernels run in the faster one, the result cast back to the model's dtype.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from engine import cpu_kernels

logger = logging.getLogger(__name__)

FORMATS = ("int8", "int8-tensor", "int4", "int4-tensor", "nf4")
NF4_BLOCK = 64
INT4_KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes `_weight_int4pack_mm_for_cpu` takes
# At M <= this our GEMVs win; above, codes -> activation dtype tile by tile + dense GEMM does (the GEMV's cost
# grows with M while the GEMM's barely does). Sapphire Rapids (AMX: the GEMMs at their fastest), bf16, int8, M = 64:
# GEMV 0.29 ms vs tiled 0.40 ms for 3072x576, 0.11 vs 0.12 for 960x576, 4.9 vs 6.1 for a 49152-row head; only
# 576x1536 lost (0.22 vs 0.18); at M = 96 they break even. The GEMVs compute on VNNI int8, which a CPU without AMX
# (where the GEMM is slower) has as well.
INT8_PACKED_MAX_M = 64
INT4_GEMV_MAX_M = 64
TORCH_INT8_MAX_M = 8  # torch's `_weight_int8pack_mm` (where ours cannot serve), as measured on Zen 4

# QLoRA's NF4 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero.
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0])


def _median_ms(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


@functools.cache
def packed_kernel_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The activation dtype torch's packed CPU kernel `kind` ("int4" or "int8") runs fastest in, for a
    model in `dtype`: bf16 where one M = 1 product at a SmolLM2 shape is at least 1.5x faster, else `dtype`."""
    if dtype == torch.bfloat16:
        return dtype
    n, k = 1536, 576
    gen = torch.Generator().manual_seed(0)
    if kind == "int4":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 1)
        sz = torch.rand(k // 64, n, 2, generator=gen)
        run = lambda d: torch.ops.aten._weight_int4pack_mm_for_cpu(torch.ones(1, k, dtype=d), packed, 64, sz.to(d))
    else:
        q = torch.randint(-127, 127, (n, k), dtype=torch.int8, generator=gen)
        s = torch.rand(n, generator=gen)
        run = lambda d: torch.ops.aten._weight_int8pack_mm(torch.ones(1, k, dtype=d), q, s.to(d))
    own, bf16 = _median_ms(lambda: run(dtype)), _median_ms(lambda: run(torch.bfloat16))
    choice = torch.bfloat16 if bf16 * 1.5 <= own else dtype
    logger.info("%s packed kernel: %s activations %.3f ms, bf16 %.3f ms: runs in %s", kind, dtype, own, bf16, choice)
    return choice


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] ints in 0..15 -> [N, K/2] uint8, element 2j in the low nibble, 2j+1 in the high one."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: [N, K/2] uint8 -> [N, K] uint8."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


PANEL = 16  # rows per panel of our int4 kernels' layout


def to_panels(codes: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles` codes [N, K/2] -> the layout of our int4 kernels (engine/csrc/quant_linear.cpp), [N/16, 8K]:
    per panel of 16 rows and per 8 codes of K, 64 bytes, row r's 4 at 4r, byte i holding code 8q + i (low nibble)
    and 8q + 4 + i (high). One 64-byte load then feeds all 16 rows."""
    n, k = codes.shape[0], codes.shape[1] * 2
    c = unpack_nibbles(codes).view(n // PANEL, PANEL, k // 8, 2, 4)  # [panel, row, q, half, i]
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(1, 2).reshape(n // PANEL, 8 * k)


def from_panels(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_panels`."""
    p, k = panels.shape[0], panels.shape[1] // 8
    b = panels.view(p, k // 8, PANEL, 4).transpose(1, 2)  # [panel, row, q, i]
    c = torch.stack((b & 15, b >> 4), dim=3).reshape(p * PANEL, k)
    return pack_nibbles(c)


def int8_to_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> our int8 kernels' layout [N/16, 16K]: per panel of 16 rows and per 4 codes of K,
    64 bytes, row r's 4 at 4r (the int4 layout's 64-byte steps, holding 4 codes of a row instead of 8)."""
    n, k = q.shape
    return q.view(n // PANEL, PANEL, k // 4, 4).transpose(1, 2).reshape(n // PANEL, PANEL * k)


def int8_from_panels(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of `int8_to_panels`."""
    p, k = panels.shape[0], panels.shape[1] // PANEL
    return panels.view(p, k // 4, PANEL, 4).transpose(1, 2).reshape(p * PANEL, k)


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    if k % group:
        raise ValueError(f"in-features {k} is not a multiple of the group size {group}")
    return w.float().reshape(n, k // group, group)


class QuantWeight(ABC):
    """One quantized [N, K] weight. `matmul(x)` computes x @ W^T in x's dtype."""

    format: str
    shape: tuple[int, int]

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: the dense [N, K] matrix this storage represents."""

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gemv_operands(self) -> tuple[list[torch.Tensor], int] | None:
        """The tensors our C++ GEMV takes (int8: codes, row scale; int4: codes, scale, bias) and the most rows it
        serves, once prepared for the CPU with our kernels built; None otherwise."""
        return None

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (what resident memory is made of)."""

    @abstractmethod
    def storage_bits(self) -> int:
        """Bits a file would need: codes plus scales at the width the format defines."""

    @abstractmethod
    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move to `device` and build the kernel layout for activations of `dtype`."""

    @classmethod
    @abstractmethod
    def cat(cls, parts: list[QuantWeight]) -> QuantWeight:
        """Row-concatenate (fused q|k|v, gate|up) before `prepare`."""

    @abstractmethod
    def take_rows(self, rows: torch.Tensor) -> QuantWeight:
        """A row subset/permutation (llama.cpp's q/k interleave), before `prepare`."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def bits_per_weight(self) -> float:
        return self.storage_bits() / (self.shape[0] * self.shape[1])


# ---- int8 ---------------------------------------------------------------------------------------
class Int8Weight(QuantWeight):
    """Symmetric int8 codes with a scale per row, per group along K, or per tensor.

    Per-row is the format `quantize` makes; group-wise (group 32) is how llama.cpp's Q8_0 maps here exactly;
    embeddings use either as a row lookup. On the CPU with our kernels, `prepare` reorders the codes into 16-row
    panels (`int8_to_panels`; engine/csrc/quant_linear.cpp: a GEMV at M <= INT8_PACKED_MAX_M, else a GEMM over
    cache-sized dequantized tiles) with the scales spelled out per group as [N/16, G, 16]. Without our kernels
    (or with N not a multiple of 16, or K not of 32) it stays row-major for torch's `_weight_int8pack_mm`.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, fmt: str = "int8") -> None:
        self.q = q  # int8 [N, K]; [N/16, 16K] panels once prepared for our kernels
        self.scale = scale  # fp16 [N, G] (G = 1: per row; 32-blocks from Q8_0), or fp32 [1, 1]; [N/16, G, 16] panels
        self.format = fmt
        self.shape = (q.shape[0], q.shape[1])
        self.group = self.shape[1] // scale.shape[1]
        self._panels = False
        self._kernel_scale: torch.Tensor | None = None  # fp32 [N] for torch's kernel (per row or tensor, row-major)

    @classmethod
    def quantize(cls, w: torch.Tensor, per_tensor: bool = False) -> Int8Weight:
        w = w.float()
        if per_tensor:
            scale = (w.abs().max().reshape(1, 1) / 127).clamp(min=1e-12)
        else:  # fp16 per row, as stored
            scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-7).half()
        q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
        return cls(q, scale, "int8-tensor" if per_tensor else "int8")

    def _row_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 [N, K] codes and [N, G] (or [1, 1]) scales, whichever layout is held."""
        if not self._panels:
            return self.q, self.scale
        return int8_from_panels(self.q), self.scale.transpose(1, 2).reshape(self.shape[0], -1)

    @staticmethod
    def _dense(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n, k = q.shape
        g = scale.shape[1]
        return (q.to(dtype).view(n, g, k // g) * scale.to(dtype)[:, :, None]).view(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q, scale = self._row_major()
        return self._dense(q, scale.expand(self.shape[0], -1), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        if self._panels:  # row n's 4-byte pieces sit at 4 (n % 16) of every 64-byte step of panel n // 16
            p, r = ids // PANEL, ids % PANEL
            q = self.q.view(-1, self.shape[1] // 4, PANEL, 4)[p, :, r].reshape(len(ids), -1)
            return self._dense(q, self.scale[p, :, r], dtype)
        scale = self.scale[ids] if self.scale.shape[0] > 1 else self.scale.expand(len(ids), -1)
        return self._dense(self.q[ids], scale, dtype)

    def kernels_take(self, device: torch.device) -> bool:
        """Whether our CPU kernels serve this matrix on `device` (any scale layout: per row, per 32, per tensor)."""
        return device.type == "cpu" and self.shape[0] % PANEL == 0 and self.group % 32 == 0 and cpu_kernels.load()

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        if self._panels:  # prepared already (a tied embedding and LM head share one storage)
            return
        self.q, self.scale = self.q.to(device), self.scale.to(device)
        n = self.shape[0]
        if self.kernels_take(device):
            scale = self.scale.expand(n, -1)
            sdtype = torch.float32 if scale.dtype == torch.float32 else torch.float16
            self.scale = scale.to(sdtype).reshape(n // PANEL, PANEL, -1).transpose(1, 2).contiguous()
            self.q = int8_to_panels(self.q)
            self._panels = True
        elif self.scale.shape[1] == 1:  # per row or per tensor: torch's kernel applies
            self._kernel_scale = self.scale.expand(n, 1).reshape(-1).float().contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels:
            op = torch.ops.pagedserve.int8_linear if x.shape[0] <= INT8_PACKED_MAX_M else torch.ops.pagedserve.int8_gemm
            return op(x, self.q, self.scale)
        s = self._kernel_scale
        if s is None:  # group-wise scales: no kernel of torch's takes them
            return F.linear(x, self.dequantize(x.dtype))
        if x.device.type == "cpu" and x.shape[0] <= TORCH_INT8_MAX_M:
            # torch's bf16 path returns garbage unless K % 32 == 0 (torch 2.13, seen in the tests): fp32 there
            kd = packed_kernel_dtype("int8", x.dtype) if self.shape[1] % 32 == 0 else torch.float32
            return torch.ops.aten._weight_int8pack_mm(x.to(kd), self.q, s.to(kd)).to(x.dtype)
        # dense GEMM on the int8 codes (exact in bf16/fp32), the per-row scale applied to the output
        return F.linear(x, self.q.to(x.dtype)) * s.to(x.dtype)

    def gemv_operands(self) -> tuple[list[torch.Tensor], int] | None:
        if not self._panels:
            return None
        return [self.q, self.scale], INT8_PACKED_MAX_M

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale] + ([self._kernel_scale] if self._kernel_scale is not None else [])

    def storage_bits(self) -> int:
        n, k = self.shape
        scale_bits = 32 * self.scale.unique().numel() if self.format == "int8-tensor" else 16 * self.scale.numel()
        return 8 * n * k + scale_bits

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> Int8Weight:
        if parts[0].format == "int8-tensor":  # one scale per original matrix, spelled out per row
            scale = torch.cat([p.scale.expand(p.shape[0], 1) for p in parts])
            return cls(torch.cat([p.q for p in parts]), scale, "int8-tensor")
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), parts[0].format)

    def take_rows(self, rows: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.q[rows], self.scale if self.scale.shape[0] == 1 else self.scale[rows], self.format)


# ---- int4 ---------------------------------------------------------------------------------------
class Int4Weight(QuantWeight):
    """4-bit codes c in 0..15 with w = (c - 8) * scale + zero per group of `group` along K.

    `quantize` is symmetric (zero = 0, the chapter's absmax with qmax 7); llama.cpp's Q4_0 maps
    exactly (zero = 0) and Q4_1's `d * c + m` maps as zero = m + 8d. On the CPU, `prepare` lays the codes
    out in 16-row panels for our kernels (`to_panels`; engine/csrc/quant_linear.cpp: a GEMV at M <=
    INT4_GEMV_MAX_M, else a GEMM over cache-sized dequantized tiles) with scale and bias = zero - 8 * scale
    [N/16, G, 16] in the scale's dtype (fp16 per group: exact for our scales and for GGUF's d and m).
    Without our kernels (or with N not a multiple of 16) it converts the codes into
    `_weight_int4pack_mm_for_cpu`'s layout (which depends on the CPU's vector width) and drops the
    row-major copy; that kernel then serves every M.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: str = "int4",
                 group: int | None = None) -> None:
        self.codes = codes  # uint8 [N, K/2] (pack_nibbles); [N/16, 8K] panels once prepared for our kernels
        self.scale = scale  # [N, G] fp16 (or fp32), or [1, 1] per tensor; [N/16, G, 16] with the panels
        self.zero = zero  # [N, G] fp32 or None
        self.format = fmt
        self.shape = (codes.shape[0], codes.shape[1] * 2)
        self.group = group or self.shape[1] // scale.shape[1]
        self._bias: torch.Tensor | None = None  # zero - 8 * scale [N/16, G, 16] for our kernels, once prepared
        self._packed: torch.Tensor | None = None  # torch's CPU kernel layout
        self._sz: torch.Tensor | None = None  # [K / kernel group, N, 2] scale and zero, activation dtype
        self._kgroup = 0

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int, per_tensor: bool = False) -> Int4Weight:
        n, k = w.shape
        if per_tensor:
            scale = (w.float().abs().max() / 7).clamp(min=1e-12).reshape(1, 1)
            q = torch.round(w.float() / scale).clamp(-8, 7) + 8
            return cls(pack_nibbles(q), scale, None, "int4-tensor", group=k)
        wg = _grouped(w, group)
        scale = (wg.abs().amax(dim=-1) / 7).clamp(min=1e-8).half()  # stored as fp16
        q = torch.round(wg / scale.float()[:, :, None]).clamp(-8, 7) + 8
        return cls(pack_nibbles(q.view(n, k)), scale, None, "int4", group=group)

    def _scale_zero_full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [N, G] scale and zero (per-tensor expanded to one group per row)."""
        scale = self.scale.float()
        if self._bias is not None:  # panels [N/16, G, 16] -> rows
            scale, bias = (t.float().transpose(1, 2).reshape(self.shape[0], -1) for t in (self.scale, self._bias))
            return scale, bias + 8 * scale
        if scale.shape[0] == 1:
            scale = scale.expand(self.shape[0], self.shape[1] // self.group)
        zero = self.zero.float() if self.zero is not None else torch.zeros_like(scale)
        return scale, zero

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        if self._packed is not None:  # the kernel on the identity matrix reads the codes back
            eye = torch.eye(k, dtype=torch.float32, device=self._packed.device)
            return self._kernel(eye, self._sz.float()).t().contiguous().to(dtype)
        scale, zero = self._scale_zero_full()
        codes = from_panels(self.codes) if self._bias is not None else self.codes
        c = unpack_nibbles(codes).float().view(n, -1, self.group)
        return ((c - 8) * scale[:, :, None] + zero[:, :, None]).view(n, k).to(dtype)

    def _kernel(self, x: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, self._kgroup, sz.to(x.dtype))

    @property
    def kernel_dtype(self) -> torch.dtype | None:
        """The activation dtype the CPU kernel runs in (None before `prepare` or without the kernel)."""
        return None if self._sz is None else self._sz.dtype

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        n, k = self.shape
        if device.type == "cpu" and self.group % 32 == 0 and n % PANEL == 0 and cpu_kernels.load():
            scale, zero = self._scale_zero_full()
            sdtype = torch.float32 if self.scale.dtype == torch.float32 else torch.float16
            self.scale, self._bias = (t.to(sdtype).view(n // PANEL, PANEL, -1).transpose(1, 2).contiguous()
                                      for t in (scale, zero - 8 * scale))
            self.codes = to_panels(self.codes)
            self.zero = None  # folded into the bias
            return
        kgroup = next((g for g in INT4_KERNEL_GROUPS if self.group % g == 0 and k % g == 0), 0)
        if device.type != "cpu" or kgroup == 0 or n % 16:
            self.codes, self.scale = self.codes.to(device), self.scale.to(device)
            self.zero = None if self.zero is None else self.zero.to(device)
            return
        scale, zero = self._scale_zero_full()
        rep = self.group // kgroup  # a format group spans rep kernel groups
        sz = torch.stack((scale, zero), dim=-1).repeat_interleave(rep, dim=1)  # [N, K/kgroup, 2]
        self._sz = sz.transpose(0, 1).contiguous().to(packed_kernel_dtype("int4", dtype))
        self._kgroup = kgroup
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            unpack_nibbles(self.codes).to(torch.int32), 1)
        self.codes = self.codes.new_empty(0)  # the kernel layout is the only copy kept

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._bias is not None:
            op = torch.ops.pagedserve.int4_linear if x.shape[0] <= INT4_GEMV_MAX_M else torch.ops.pagedserve.int4_gemm
            return op(x, self.codes, self.scale, self._bias)
        if self._packed is not None:
            return self._kernel(x.to(self._sz.dtype), self._sz).to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype))

    def gemv_operands(self) -> tuple[list[torch.Tensor], int] | None:
        if self._bias is None:
            return None
        return [self.codes, self.scale, self._bias], INT4_GEMV_MAX_M

    def tensors(self) -> list[torch.Tensor]:
        if self._packed is not None:
            return [self._packed, self._sz]
        return [t for t in (self.codes, self.scale, self.zero, self._bias) if t is not None]

    def storage_bits(self) -> int:
        n, k = self.shape
        if self.format == "int4-tensor":
            return 4 * n * k + 32 * self.scale.unique().numel()
        has_zero = self.zero is not None or (self._bias is not None and bool((self._bias != -8 * self.scale).any()))
        per_group = 32 if has_zero else 16
        return 4 * n * k + per_group * n * (k // self.group)

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> Int4Weight:
        if parts[0].format == "int4-tensor":  # one scale per original matrix, spelled out per row
            scale = torch.cat([p.scale.expand(p.shape[0], 1) for p in parts])
            return cls(torch.cat([p.codes for p in parts]), scale, None, "int4-tensor", parts[0].shape[1])
        if len({p.group for p in parts}) != 1 or len({p.zero is None for p in parts}) != 1:
            raise ValueError("cannot fuse int4 weights with different groups or zero-point use")
        zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zero,
                   parts[0].format, parts[0].group)

    def take_rows(self, rows: torch.Tensor) -> Int4Weight:
        per_tensor = self.scale.shape[0] == 1
        return Int4Weight(self.codes[rows], self.scale if per_tensor else self.scale[rows],
                          None if self.zero is None else self.zero[rows], self.format, self.group)


# ---- NF4 ----------------------------------------------------------------------------------------
class NF4Weight(QuantWeight):
    """QLoRA's NF4: 16 normal-quantile levels times an fp16 absmax per block of 64 along K.

    No packed kernel exists for it on CPU or CUDA in torch: every M dequantizes then runs a GEMM.
    """

    format = "nf4"

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor) -> None:
        self.codes = codes  # uint8 [N, K/2]
        self.absmax = absmax  # fp16 [N, K/block]
        self.shape = (codes.shape[0], codes.shape[1] * 2)
        self.block = self.shape[1] // absmax.shape[1]
        self._levels = NF4_LEVELS

    @classmethod
    def quantize(cls, w: torch.Tensor) -> NF4Weight:
        n, k = w.shape
        # QLoRA's block of 64; 32 where the in-features are not a multiple of 64
        wg = _grouped(w, NF4_BLOCK if k % NF4_BLOCK == 0 else NF4_BLOCK // 2)
        absmax = wg.abs().amax(dim=-1).clamp(min=1e-8).half()
        normed = wg / absmax.float()[:, :, None]
        # nearest level: midpoints between sorted levels are the decision boundaries
        mids = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
        codes = torch.bucketize(normed.reshape(-1), mids).view(n, k)
        return cls(pack_nibbles(codes), absmax)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        vals = self._levels.to(dtype)[unpack_nibbles(self.codes).long()].view(n, -1, self.block)
        return (vals * self.absmax.to(dtype)[:, :, None]).view(n, k)

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        self.codes, self.absmax = self.codes.to(device), self.absmax.to(device)
        self._levels = NF4_LEVELS.to(device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.absmax]

    def storage_bits(self) -> int:
        n, k = self.shape
        return 4 * n * k + 16 * self.absmax.numel()

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> NF4Weight:
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.absmax for p in parts]))

    def take_rows(self, rows: torch.Tensor) -> NF4Weight:
        return NF4Weight(self.codes[rows], self.absmax[rows])


# ---- entry points -------------------------------------------------------------------------------
def default_group_size(in_features: list[int]) -> int:
    """The largest of 128/64/32 dividing every matrix's in-features (SmolLM2's 576 -> 64)."""
    for g in (128, 64, 32):
        if all(k % g == 0 for k in in_features):
            return g
    raise ValueError(f"no int4 group size in (128, 64, 32) divides every in-feature size {sorted(set(in_features))}")


def quantize(w: torch.Tensor, fmt: str, group_size: int = 64) -> QuantWeight:
    """Dense [N, K] -> the format's storage (on w's device, before `prepare`)."""
    if fmt == "int8":
        return Int8Weight.quantize(w)
    if fmt == "int8-tensor":
        return Int8Weight.quantize(w, per_tensor=True)
    if fmt == "int4":
        return Int4Weight.quantize(w, group_size)
    if fmt == "int4-tensor":
        return Int4Weight.quantize(w, group_size, per_tensor=True)
    if fmt == "nf4":
        return NF4Weight.quantize(w)
    raise ValueError(f"unknown quantization {fmt!r}; choose from none, {', '.join(FORMATS)}")


def cat(parts: list[QuantWeight]) -> QuantWeight:
    if len(parts) == 1:
        return parts[0]
    kinds = {(type(p), p.format) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse weights of different formats {sorted(f for _, f in kinds)}")
    return type(parts[0]).cat(parts)


def relative_error(w: torch.Tensor, qw: QuantWeight) -> float:
    """‖W − Ŵ‖ / ‖W‖ (Frobenius), in fp32."""
    w = w.float()
    return (math.sqrt(((w - qw.dequantize()) ** 2).sum().item()) / max(w.norm().item(), 1e-30))
