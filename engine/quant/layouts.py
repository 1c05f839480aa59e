"""How quantized codes sit in memory: 4-bit codes two to a byte, and the 16-row panels our C++ kernels read.

Panels exist so that one 64-byte load feeds 16 output rows at once (engine/csrc/panels.h).
"""

from __future__ import annotations

import torch

PANEL = 16  # rows per panel of our kernels' layout


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] ints in 0..15 -> [N, K/2] uint8, element 2j in the low nibble, 2j+1 in the high one."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: [N, K/2] uint8 -> [N, K] uint8."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


def to_panels(codes: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles` codes [N, K/2] -> our int4 kernels' layout [N/16, 8K]: per panel of 16 rows and per 8 codes
    of K, 64 bytes, row r's 4 at 4r, byte i holding code 8q + i (low nibble) and 8q + 4 + i (high)."""
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


def rows_to_panels(t: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, G] (scales, biases) -> [N/16, G, 16], beside the panels they scale."""
    n = t.shape[0]
    return t.reshape(n // PANEL, PANEL, -1).transpose(1, 2).contiguous()


def value_rows(v: torch.Tensor | None, rows: torch.Tensor | slice, n: int, panels: bool) -> torch.Tensor | None:
    """Per-group values [R, G] of `rows` (int64 ids or a slice) from v [N, G], [1, G] (one for every row) or, in
    panels, [N/16, G, 16]. Only the rows asked for: an embedding lookup costs its tokens, not the vocabulary."""
    if v is None:
        return None
    if panels:
        return v.transpose(1, 2).reshape(n, -1)[rows] if isinstance(rows, slice) else v[rows // PANEL, :, rows % PANEL]
    return v.expand(n, -1)[rows] if v.shape[0] == 1 else v[rows]


def int6_to_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 codes -32..31 [N, K] -> our int6 kernels' layout [N/16, 12K] of c + 32: per 32 codes of a panel, the
    int4 layout's 4 steps of their low 4 bits (256 bytes), then 2 x 64 bytes of their high 2 bits: byte 4r + i of
    piece h holds row r's codes 16h + i, 16h + 4 + i, 16h + 8 + i, 16h + 12 + i in bits 0-1, 2-3, 4-5, 6-7."""
    n, k = q.shape
    c = (q.to(torch.int16) + 32).to(torch.uint8)
    low = to_panels(pack_nibbles(c & 15)).view(n // PANEL, k // 32, 256)
    hi = (c >> 4).view(n // PANEL, PANEL, k // 32, 2, 4, 4)  # [panel, row, block, piece h, slot j, i]
    pieces = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)  # [.., row, blk, h, i]
    pieces = pieces.permute(0, 2, 3, 1, 4).reshape(n // PANEL, k // 32, 128)  # [panel, block, h, row, i]
    return torch.cat((low, pieces), dim=2).reshape(n // PANEL, 12 * k)


def int6_from_panels(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of `int6_to_panels`: int8 codes [N, K]."""
    p, k = panels.shape[0], panels.shape[1] // 12
    b = panels.view(p, k // 32, 384)
    low = unpack_nibbles(from_panels(b[:, :, :256].reshape(p, 8 * k)))  # [N, K]
    pieces = b[:, :, 256:].reshape(p, k // 32, 2, PANEL, 4).permute(0, 3, 1, 2, 4)  # [panel, row, blk, h, i]
    hi = torch.stack([(pieces >> (2 * j)) & 3 for j in range(4)], dim=-2)  # [panel, row, blk, h, j, i]
    return ((low | (hi.reshape(p * PANEL, k) << 4)).to(torch.int16) - 32).to(torch.int8)
