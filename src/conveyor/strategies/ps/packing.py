"""Pieces packed into few frames: consecutive flat pieces of one dtype back to back, up to ``PACK_BYTES`` a frame.

    frames, sizes = pack(values)           # sizes is None when packing would not save a frame
    values = unpack(sizes, frames)          # views of the frames, one per piece; ValueError when they disagree

A ps message carries one value per piece. Each frame costs a signature (a GMAC), a ZeroMQ send and a
decode on both sides, so the 65 pieces of a ResNet-20 in 65 frames cost several times what the same
bytes cost in one. Packing copies the pieces once (a ``torch.cat``) and the header's ``sizes`` says
where to cut. A piece larger than ``PACK_BYTES`` travels alone, so no frame is larger than the
pieces themselves or ``PACK_BYTES``: within what every ps task accepts (``server.max_frame_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PACK_BYTES", "pack", "unpack"]

#: Consecutive pieces share a frame up to this many bytes.
PACK_BYTES = 1 << 20


def pack(values: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int] | None]:
    """``(frames, sizes)``: the pieces (flattened) in as few frames as the rules allow, and each piece's
    element count; ``(the pieces, None)`` when that would not save a frame (or a piece is empty)."""
    flat = [v.reshape(-1) for v in values]
    runs: list[list[torch.Tensor]] = []
    size = 0
    for value in flat:
        nbytes = value.numel() * value.element_size()
        if not runs or size + nbytes > PACK_BYTES or value.dtype != runs[-1][0].dtype:
            runs.append([])
            size = 0
        runs[-1].append(value)
        size += nbytes
    if len(runs) == len(flat) or any(v.numel() == 0 for v in flat):
        return list(values), None
    return [run[0] if len(run) == 1 else torch.cat(run) for run in runs], [int(v.numel()) for v in flat]


def unpack(sizes: Sequence[int], frames: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One view per size, cut from ``frames`` in order; ``ValueError`` (what is wrong) unless every frame is
    1-d and holds whole pieces, and the pieces fill the frames exactly."""
    values: list[torch.Tensor] = []
    index, used = -1, 0
    for size in sizes:
        if size <= 0:
            raise ValueError("lists a piece of no elements (packed pieces have at least one)")
        if index < 0 or used == frames[index].numel():
            index, used = index + 1, 0
            if index >= len(frames):
                raise ValueError(f"lists {sum(sizes)} elements; the frames hold fewer")
            if not isinstance(frames[index], torch.Tensor) or frames[index].dim() != 1:
                raise ValueError(f"frame {index} is not a 1-d tensor")
        if used + size > frames[index].numel():
            raise ValueError(f"cuts a piece across frames {index} and {index + 1} (pieces travel whole)")
        values.append(frames[index][used:used + size])
        used += size
    if index != len(frames) - 1 or (frames and used != frames[index].numel()):
        raise ValueError(f"lists {sum(sizes)} elements for {len(frames)} frames of other sizes")
    return values
