"""llama.cpp's block-quantized GGUF tensors, and our storage holding exactly their values.

A GGUF matrix of a quantized type is rows of blocks; each block holds codes and the scales (and mins) that turn
them into weights. Every type here maps onto the codes-times-group-values storage our kernels read
(engine/quant/int4.py, int8.py: w = c * scale + bias per group along K), with no rounding:

| type | block         | weight                          | our storage                                              |
|------|---------------|---------------------------------|----------------------------------------------------------|
| Q4_0 | 32, fp16 d    | d (q - 8)                       | int4, group 32, scale d                                  |
| Q4_1 | 32, d, m      | d q + m                         | int4, group 32, scale d, bias m                          |
| Q5_0 | 32, d         | d (q - 16)                      | 6-bit codes q - 16, group 32, scale d                    |
| Q5_1 | 32, d, m      | d q + m                         | 6-bit codes q, group 32, scale d, bias m                 |
| Q8_0 | 32, d         | d q                             | int8, group 32, scale d                                  |
| Q4_K | 256: d, dmin; 8 x 6-bit (sc, m) | d sc q - dmin m | int4, group 32, scale sc x d, bias m x (-dmin)          |
| Q5_K | as Q4_K, 5-bit q | d sc q - dmin m              | 6-bit codes q, group 32, scale sc x d, bias m x (-dmin)  |
| Q6_K | 256: d; 16 x int8 sc | d sc (q - 32)            | 6-bit codes q - 32, group 16, scale sc x d               |

"sc x d": the 6- or 8-bit sub-block codes kept as they are with the super-block's fp16 factor beside them, so
the kernels form the product in fp32, exact (an fp16 copy of d * sc would round). 5- and 6-bit codes are held in
int8 storage (codes within -32..31, or 0..31) and laid out 6 bits a code for our kernels (int6_to_panels in
engine/quant/layouts.py). `dequantize` is gguf's own
reference; tests hold `storage(...).dequantize()` to it bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from .int4 import Int4Weight
from .int8 import Int8Weight
from .layouts import pack_nibbles
from .weight import QuantWeight

BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
MAPPED = tuple(BLOCK_WEIGHTS)


class GGUFBlocks:
    """A GGUF matrix of a block-quantized type, as its raw bytes [rows, bytes per row]."""

    def __init__(self, kind: str, data: np.ndarray, shape: tuple[int, int]) -> None:
        self.kind, self.data, self.shape = kind, data, shape

    def dequantize(self) -> torch.Tensor:
        """gguf's reference dequantization, fp32 [rows, K]."""
        import gguf

        dense = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.asarray(dense, dtype=np.float32).reshape(self.shape))

    @property
    def mapped(self) -> bool:
        return self.kind in MAPPED

    def storage(self) -> QuantWeight:
        """Our storage holding exactly these values (format named by the type), not yet laid out."""
        n, k = self.shape
        size = BLOCK_WEIGHTS[self.kind]
        b = np.ascontiguousarray(self.data).reshape(n * (k // size), BLOCK_BYTES[self.kind])
        return _DECODERS[self.kind](b, n, k)


def _half(b: np.ndarray, n: int) -> torch.Tensor:
    """Two bytes a block -> fp16 [n, blocks per row]."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16).reshape(n, -1).copy())


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] codes: the low nibbles are elements 0-15, the high ones 16-31."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's [blocks, 4] bytes -> [blocks, 32] fifth bits (bit j of the little-endian word: element j)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _int4_codes(c: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Codes 0..15 -> int4 storage's packed [n, k/2]."""
    return pack_nibbles(torch.from_numpy(c.reshape(n, k).astype(np.uint8)))


def _int8_codes(c: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(c.reshape(n, k).astype(np.int8))


def _q4_0(b, n, k):
    return Int4Weight(_int4_codes(_nibbles(b[:, 2:]), n, k), _half(b[:, :2], n), None, "Q4_0", 32)


def _q4_1(b, n, k):
    return Int4Weight(_int4_codes(_nibbles(b[:, 4:]), n, k), _half(b[:, :2], n), _half(b[:, 2:4], n), "Q4_1", 32)


def _q5_0(b, n, k):
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return Int8Weight(_int8_codes(q.astype(np.int16) - 16, n, k), _half(b[:, :2], n), "Q5_0")


def _q5_1(b, n, k):
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return Int8Weight(_int8_codes(q, n, k), _half(b[:, :2], n), "Q5_1", bias=_half(b[:, 2:4], n))


def _q8_0(b, n, k):
    return Int8Weight(_int8_codes(b[:, 2:].view(np.int8), n, k), _half(b[:, :2], n), "Q8_0")


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4)."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate((d & 63, (md & 15) | ((d >> 2) & 48)), axis=-1)
    mn = np.concatenate((m & 63, (md >> 4) | ((m >> 2) & 48)), axis=-1)
    return sc, mn


def _k_values(b: np.ndarray, n: int) -> tuple[torch.Tensor, ...]:
    """Q4_K/Q5_K's d, dmin, scale codes and min codes: scale = sc x d, bias = m x (-dmin), per group of 32."""
    sc, mn = _k_scales(b[:, 4:16])
    d, dmin = _half(b[:, :2], n), _half(b[:, 2:4], n)
    return (torch.from_numpy(sc.reshape(n, -1).copy()), d, torch.from_numpy(mn.reshape(n, -1).copy()), -dmin)


def _q4_k(b, n, k):
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    sc, d, mn, neg_dmin = _k_values(b, n)
    return Int4Weight(_int4_codes(qs & 15, n, k), sc, mn, "Q4_K", 32, d, neg_dmin)


def _q5_k(b, n, k):
    ql = (b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    sc, d, mn, neg_dmin = _k_values(b, n)
    q = ql.reshape(-1, 8, 32) | (qh << 4)
    return Int8Weight(_int8_codes(q, n, k), sc, "Q5_K", bias=mn, scale_d=d, bias_d=neg_dmin)


def _q6_k(b, n, k):
    ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    sc = torch.from_numpy(b[:, 192:208].view(np.int8).reshape(n, -1).copy())
    return Int8Weight(_int8_codes(q, n, k), sc, "Q6_K", scale_d=_half(b[:, 208:210], n))


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k}
