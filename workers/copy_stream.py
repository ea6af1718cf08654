"""The side CUDA stream that carries the KV cache's host<->GPU copies, and the two events that
order it against the compute stream.

Swap-out and offload (GPU -> pinned host) and swap-in and load (pinned host -> GPU) run on one
copy stream, so the copy engine moves blocks while the compute stream stages the step's inputs,
and no copy ever waits on the host. Ordering, per step (`begin` ... copies ... `end`, `wait`):

  1. `begin`: the copy stream waits on an event recorded on the compute stream, i.e. on every
     kernel enqueued before this step's copies: whatever last wrote a block that is copied
     out, and whatever last read or wrote a block that a copy in overwrites. (This is a
     superset of the exact dependency; the scheduler does not tell workers which step last
     touched a block, and with async scheduling the step before may still be running.)
  2. The copies, in the plan's order, on the copy stream: one stream keeps host blocks in
     order too (a load reads a tier block after the offload that wrote it; an offload of a
     later step overwrites a tier block only after an earlier load of it has read it).
  3. `end`: an event recorded on the copy stream after the last copy.
  4. `wait`: the compute stream waits on that event before anything that reads a loaded or
     swapped-in block or writes a block that was copied out (the forward, copy-on-write).
     A step with no copies records and waits on nothing.

Nothing is allocated per step: the stream, both events and the stream context are made once;
the host buffers are pinned once and the device staging block allocated once by the
CacheEngine, which `share`s its device tensors with the copy stream (so freeing the cache
waits for copies still queued on them). On CPU there is no stream: the same
calls run, copies run in place, in program order, and `begin` / `end` / `wait` do nothing.
"""

from __future__ import annotations

import contextlib

import torch


class CopyStream:
    """A copy stream with its ordering events (see the module docstring); inert on CPU."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._compute_ready = torch.cuda.Event() if cuda else None
        self._copies_done = torch.cuda.Event() if cuda else None
        self._context = (torch.cuda.stream(self.stream) if self.stream is not None
                         else contextlib.nullcontext())
        self.pending = False  # copies enqueued that the compute stream has not waited on yet

    def share(self, *tensors: torch.Tensor) -> None:
        """Device tensors the copy stream uses, allocated on the compute stream: when one is
        freed, the caching allocator waits for the copy stream's work on it before reusing it."""
        if self.stream is not None:
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(self.stream)

    def begin(self) -> None:
        """Order the copies about to be enqueued after all work on the compute stream, and make
        the copy stream current until `end`."""
        if self.stream is not None:
            self._compute_ready.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(self._compute_ready)
        self._context.__enter__()

    def end(self) -> None:
        """Back to the compute stream; the copies enqueued since `begin` are what `wait`
        waits for."""
        self._context.__exit__(None, None, None)
        if self.stream is not None:
            self._copies_done.record(self.stream)
        self.pending = True

    def wait(self) -> None:
        """The compute stream waits (on the device, not the host) for every copy so far."""
        if not self.pending:
            return
        self.pending = False
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copies_done)
