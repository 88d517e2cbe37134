"""CRC-32C (Castagnoli) and TensorFlow's CRC mask, as used by the TFRecord framing.

The CRC itself comes from ``google_crc32c`` (a C extension using SSE4.2/ARMv8 instructions): a
pure-Python CRC would cost more than the rest of record reading put together.

TensorFlow never stores a raw CRC in a file; it stores a *masked* one, because "it is problematic
to compute the CRC of a string that contains embedded CRCs" (``tsl/lib/hash/crc32c.h``). Masking
is a 15-bit rotation plus a constant, done in 32-bit arithmetic.
"""

from __future__ import annotations

import google_crc32c

__all__ = ["MASK_DELTA", "crc32c", "mask", "masked_crc32c", "unmask"]

MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF

_crc_value = google_crc32c.value


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """Return the (unmasked) CRC-32C of ``data``."""
    if type(data) is not bytes:  # the C extension takes only bytes, not other buffers
        data = bytes(data)
    return _crc_value(data)


def mask(crc: int) -> int:
    """Mask a CRC the way TensorFlow does before storing it."""
    return ((((crc >> 15) | (crc << 17)) & _U32) + MASK_DELTA) & _U32


def unmask(masked: int) -> int:
    """Invert :func:`mask`."""
    rot = (masked - MASK_DELTA) & _U32
    return ((rot >> 17) | (rot << 15)) & _U32


def masked_crc32c(data: bytes | bytearray | memoryview) -> int:
    """Return the masked CRC-32C of ``data``: the value a TFRecord file stores."""
    crc = _crc_value(data if type(data) is bytes else bytes(data))
    return ((((crc >> 15) | (crc << 17)) & _U32) + MASK_DELTA) & _U32
