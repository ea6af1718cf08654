"""A step's host-made inputs go to the device in one copy, from buffers allocated once.

`InputStager.stage` takes the step's numpy arrays grouped by dtype (int64, int32, float32),
packs each group with one `np.concatenate` into a pinned host buffer, copies the used bytes to
the device with one non-blocking H2D copy, and hands back device views of every array (one
`split` per group). On CPU the "device" buffer is the host buffer itself: no copy at all.

Buffers form a ring of `depth` slots, so the host can pack step N+1 while step N's copy is
still queued behind the GPU's work. The device views of a slot are made once per layout (the
arrays' sizes) and reused: making tensor views costs microseconds each. Invariant: a slot is written again only after its last
copy has run (its event is checked; with at most two steps in flight that wait never blocks).
The views a step gets stay valid until the ring comes back to its slot, `depth` steps later.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_GROUPS = ((np.int64, torch.int64), (np.int32, torch.int32), (np.float32, torch.float32))
_NP_DTYPES = tuple(np_dtype for np_dtype, _ in _GROUPS)
_ITEMSIZES = tuple(np.dtype(np_dtype).itemsize for np_dtype in _NP_DTYPES)
_MAX_LAYOUTS = 512  # cached (slot, sizes) layouts; a steady batch reuses one per slot
_ALIGN = 64  # bytes: each dtype group starts on its own cache line


class _Slot:
    def __init__(self, nbytes: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device) if cuda else self.host
        self.copied = torch.cuda.Event() if cuda else None


class InputStager:
    """Ring of pinned staging buffers and their device twins (see the module docstring)."""

    def __init__(self, device: torch.device, nbytes: int = 1 << 20, depth: int = 3) -> None:
        self.device = device
        self.depth = depth
        self.nbytes = nbytes
        self._slots = [_Slot(nbytes, device) for _ in range(depth)]
        self._next = 0
        self._layouts: dict[tuple, tuple] = {}

    def stage(self, *groups: list[np.ndarray | None]) -> tuple[list[list[Tensor | None]],
                                                              list[Tensor]]:
        """Device views of `groups` = (int64 arrays, int32 arrays, float32 arrays), in order
        (None for a None entry: nothing staged), and each group's whole region (its arrays
        back to back, for a one-copy hand-off). Arrays are cast to their group's dtype."""
        # (one flat tuple and the groups' lengths: cheaper to build and hash than nested ones)
        key = (self._next, tuple(map(len, groups)),
               tuple([-1 if a is None else len(a) for arrays in groups for a in arrays]))
        index = self._next
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(key)
        packs, end, views, regions = layout
        slot = self._slots[index]
        self._next = (index + 1) % self.depth
        if slot.copied is not None and not slot.copied.query():
            # Its copy of `depth` steps ago still queued: only if the caller launched more
            # steps than the ring holds without collecting any (the worker never does).
            slot.copied.synchronize()
        for arrays, (out, present) in zip(groups, packs):
            if out is None:  # (nothing to stage: no arrays, or only empty ones)
                continue
            if len(present) == 1:  # (an assignment casts as concatenate does, at less cost)
                out[...] = arrays[present[0]]
            else:
                np.concatenate([arrays[i] for i in present], out=out, casting="unsafe")
        if slot.copied is not None:
            slot.device[:end].copy_(slot.host[:end], non_blocking=True)
            slot.copied.record()
        return views, regions

    def _layout(self, key: tuple) -> tuple:
        """Per group, the host array it is packed into (None: an empty group) and the indices
        of its arrays present; the total size; device views of one slot for arrays of these
        sizes (-1: absent). Made once per (slot, sizes) and reused: a steady batch makes no
        views."""
        index, lengths, flat = key
        sizes, at = [], 0
        for n in lengths:
            sizes.append(flat[at:at + n])
            at += n
        ranges, end = [], 0
        for itemsize, counts in zip(_ITEMSIZES, sizes):
            n = sum(c for c in counts if c > 0)
            ranges.append((end, end + n * itemsize))
            end += -(-n * itemsize // _ALIGN) * _ALIGN
        if end > self.nbytes:
            self._grow(end)
        slot = self._slots[index]
        packs, views, regions = [], [], []
        for (np_dtype, torch_dtype), counts, (start, stop) in zip(_GROUPS, sizes, ranges):
            packs.append((slot.host_np[start:stop].view(np_dtype) if stop > start else None,
                          tuple(i for i, c in enumerate(counts) if c >= 0)))
            region = slot.device[start:stop].view(torch_dtype)
            regions.append(region)
            split = iter(region.split([c for c in counts if c >= 0]))
            views.append([None if c < 0 else next(split) for c in counts])
        if len(self._layouts) >= _MAX_LAYOUTS:
            self._layouts.clear()
        layout = (packs, end, views, regions)
        self._layouts[key] = layout
        return layout

    def _grow(self, nbytes: int) -> None:
        """A step larger than any before (start-up sizes it for the largest batch, so rare)."""
        for slot in self._slots:
            if slot.copied is not None:
                slot.copied.synchronize()
        self.nbytes = max(nbytes, 2 * self.nbytes)
        self._slots = [_Slot(self.nbytes, self.device) for _ in range(self.depth)]
        self._next = 0
        self._layouts.clear()
