"""A GGUF file's metadata and tensor table, read in one pass with `struct` over a memory map.

gguf's own `GGUFReader` builds a numpy view for every part of every value, each string of the vocabulary
included: seconds for a 49k-token vocabulary and more for Llama 3's 128k, paid on every start, by every
tensor-parallel rank and for a draft model again. This reads the same layout (GGUF v2 and v3, little-endian)
into plain Python values and keeps gguf for what it does well: the type table and the dequantizers.
tests/test_gguf_file.py checks it against `GGUFReader`.
"""

from __future__ import annotations

import mmap
import struct
from math import prod
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_VALUES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}  # others come as bytes


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order, fastest-moving dimension first
    data: np.ndarray  # values (F32, F16), else the raw bytes, one row of blocks per row


class GGUFFile:
    """`fields`: metadata key -> value (numbers, strings, lists of them); `tensors`: the table, in file order."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the tensors' arrays keep it open
        self._pos = 0
        magic, version = self._read("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
        num_tensors, num_fields = self._read("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._read("<I")[0])
        table = []
        for _ in range(num_tensors):
            name = self._string()
            dims = self._read(f"<{self._read('<I')[0]}Q")
            kind, offset = self._read("<IQ")
            table.append((name, GGMLQuantizationType(kind), tuple(int(d) for d in dims), offset))
        align = self.fields.get("general.alignment", 32)
        start = -(-self._pos // align) * align
        self.tensors = [GGUFTensor(name, kind, dims, self._tensor_data(start + offset, kind, dims))
                        for name, kind, dims, offset in table]

    def _read(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._read("<Q")
        self._pos += n
        return self._map[self._pos - n:self._pos].decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._read("<IQ")
            if item in _SCALARS:  # one read for the whole array
                return list(self._read(f"<{count}{_SCALARS[item][1]}"))
            return [self._value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._read(_SCALARS[kind])[0]

    def _tensor_data(self, offset: int, kind: GGMLQuantizationType, dims: tuple[int, ...]) -> np.ndarray:
        shape = tuple(reversed(dims))
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = prod(dims) // block * size
        if offset + nbytes > len(self._map):
            raise ValueError(f"tensor data runs past the end of the file ({offset + nbytes} > {len(self._map)} bytes)")
        if kind in _VALUES:
            return np.frombuffer(self._map, _VALUES[kind], nbytes // size, offset).reshape(shape)
        return np.frombuffer(self._map, np.uint8, nbytes, offset).reshape(*shape[:-1], shape[-1] // block * size)
