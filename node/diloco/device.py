"""Where an island's tensors cross between its device and the host.

On a GPU the island keeps its global fragments on the device too, so pseudo-gradients, their
quantisation and the adoption of versions run there; only three things cross:

* a contribution's encoded bytes (payloads, scales and the finite flags), device → host, into a
  reused pinned buffer per fragment, one wait per contribution (``to_host``);
* an arrived version, host → device, through a reused pinned buffer per fragment, with no wait at
  all on the trainer's side: the copy runs on the network side's own stream and the trainer's
  stream waits for its event (``to_device``, then ``arrive`` on the trainer thread);
* the island's own fragment at start-up (its global copy), once.

The network side's work (encoding, copies) runs on its own CUDA stream (``side``), which first
waits for the event the trainer recorded after computing the pseudo-gradient; training's stream
never waits for the network. Tensors allocated on one stream and used on the other are marked
with ``record_stream`` so the caching allocator does not hand their memory out too early.

On the CPU (``DeviceLink(cpu)``) nothing is staged and every method is the identity: the code
that runs is today's CPU path. ``staged=True`` on the CPU runs the staging path (host buffers,
``non_blocking`` copies: a no-op flag on the CPU), pinned when torch has CUDA, for tests.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["DeviceLink", "Landed", "pinning_available"]

_ALIGN = 64  # each part's offset in a host buffer: aligned for any dtype's view


def pinning_available() -> bool:
    """Whether page-locked host memory can be had (it needs a CUDA build with a device)."""
    return torch.cuda.is_available()


class Landed(NamedTuple):
    """A global fragment as delivered: its host copy (what the network side keeps), and when the
    island trains on a device, its device copy and the event that says the copy is done."""

    host: torch.Tensor
    device: torch.Tensor | None = None
    ready: Any = None  # torch.cuda.Event | None


class DeviceLink:
    """One island's crossings between ``device`` and the host (thread-safe)."""

    def __init__(self, device: torch.device, *, staged: bool | None = None) -> None:
        """``staged``: copy through host buffers (default: when ``device`` is not the CPU).
        Raises ``ValueError`` for an unstaged link to a device other than the CPU."""
        self.device = device
        self.staged = device.type != "cpu" if staged is None else staged
        if not self.staged and device.type != "cpu":
            raise ValueError(f"a link to {device} must be staged")
        self.pinned = self.staged and pinning_available()
        self.cuda = device.type == "cuda"
        # a copy that returns before it is done is waited for by an event: CUDA's; the CPU's
        # copies are done when they return (the flag is a no-op there)
        self._non_blocking = device.type in ("cuda", "cpu")
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._buffers: dict[Hashable, torch.Tensor] = {}  # reused host buffers, by key
        self._busy: set[Hashable] = set()
        self._copied: dict[Hashable, Any] = {}  # key -> event: its last host → device copy done
        self._lock = threading.Lock()

    # --- the trainer's stream --------------------------------------------------------------------
    def record(self) -> Any:
        """An event on the current stream (None off CUDA): what the network side waits for."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def arrive(self, landed: Landed) -> torch.Tensor:
        """``landed``'s copy on the island's device, usable on the current stream (trainer thread):
        the stream waits for the copy's event, and no host wait happens."""
        if landed.device is None:
            return landed.host
        if landed.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(landed.ready)
            landed.device.record_stream(stream)
        return landed.device

    # --- the network side ------------------------------------------------------------------------
    @contextlib.contextmanager
    def side(self, after: Any = None, *uses: torch.Tensor) -> Iterator[None]:
        """Run the block on the network side's stream, after the event ``after``; ``uses``:
        tensors made on another stream that the block reads."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            for t in uses:
                t.record_stream(self._stream)
            yield

    def to_host(self, parts: Sequence[torch.Tensor], key: Hashable | None) -> list[torch.Tensor]:
        """Copy ``parts`` (on the device, in the current stream's order) into one host buffer with
        non-blocking copies and one wait; returns the host tensors (1-D views of the buffer).
        ``key``: reuse that key's buffer (pinned on CUDA), held until ``release(key)``; None: a
        fresh buffer, which the caller may keep. Off a staged link: the parts themselves."""
        if not self.staged:
            return list(parts)
        sizes = [p.numel() * p.element_size() for p in parts]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        buffer = self._borrow(key, total)
        out = []
        for part, offset, size in zip(parts, offsets, sizes, strict=True):
            host = buffer[offset : offset + size].view(part.dtype)
            host.copy_(part.detach().reshape(-1), non_blocking=self._non_blocking)
            out.append(host)
        done = self.record()  # one wait for all of them (the current stream: ``side``'s)
        if done is not None:
            done.synchronize()
        return out

    def release(self, key: Hashable) -> None:
        """The host buffer of ``key`` (from ``to_host``) may be reused."""
        with self._lock:
            self._busy.discard(key)

    def to_device(self, host: torch.Tensor, key: Hashable | None) -> Landed:
        """Start copying ``host`` (a CPU tensor) to the device, through the pinned buffer of
        ``key`` (None: a fresh one), on the network side's stream; returns at once (after a CPU
        copy into the pinned buffer). Off a staged link: ``Landed(host)``."""
        if not self.staged:
            return Landed(host)
        nbytes = host.numel() * host.element_size()
        with self._lock:
            previous = self._copied.pop(key, None) if key is not None else None
        if previous is not None:
            previous.synchronize()  # that key's buffer is still being read by the last copy
        stage = self._buffer(key, nbytes)[:nbytes].view(host.dtype).view(host.shape)
        stage.copy_(host)
        with self.side():
            on_device = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            on_device.copy_(stage, non_blocking=self._non_blocking)
            ready = self.record()
        if ready is not None and key is not None:
            with self._lock:
                self._copied[key] = ready
        elif ready is not None:
            ready.synchronize()  # a fresh pinned buffer: keep it alive until the copy is done
        return Landed(host, on_device, ready)

    # --- host buffers ----------------------------------------------------------------------------
    def _borrow(self, key: Hashable | None, nbytes: int) -> torch.Tensor:
        """A host buffer of at least ``nbytes`` for ``key``, marked busy (a busy key: a fresh one)."""
        with self._lock:
            if key is not None and key in self._busy:
                key = None
            if key is not None:
                self._busy.add(key)
        return self._buffer(key, nbytes)

    def _buffer(self, key: Hashable | None, nbytes: int) -> torch.Tensor:
        """``key``'s host buffer if it holds ``nbytes``, else a new one (kept for ``key``)."""
        with self._lock:
            held = self._buffers.get(key) if key is not None else None
        if held is not None and held.numel() >= nbytes:
            return held
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        if key is not None:
            with self._lock:
                self._buffers[key] = buffer
        return buffer
