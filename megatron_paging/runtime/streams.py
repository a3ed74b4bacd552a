"""Stream backends for the paging scheduler: where paging work runs and how streams wait.

The scheduler never calls ``torch.cuda`` directly; it talks to a backend with five verbs:

* ``compute_stream()`` — the stream the model computes on right now (the current stream);
* ``paging_stream`` — the high-priority stream that carries every stash and reload, except
  offloaded live rows: ``offload_stream(row_bytes)``, one per offload pool (same priority), so
  that one pool's PCIe copy never queues another pool's copy behind it;
* ``record(stream, what)`` — record an event on a stream (``what`` names it in logs);
* ``wait(stream, event, reason)`` — make ``stream`` wait for ``event``;
* ``launch(stream, kind, fn, **info)`` — run ``fn`` with ``stream`` current (enqueue its kernels);
* ``scope(stream)`` — a context in which launches on ``stream`` need not switch streams: the
  scheduler opens it once around each commit group / reload group, so a group of records costs
  one stream switch, not one per record.

plus ``done(event)`` (has the event completed? never asked during graph capture),
``capturing()`` (is the compute stream being captured into a CUDA graph?) and
``keep_alive(tensor, stream)`` (``stream`` uses ``tensor``: its memory must not be reused before
that stream's queued work is done — ``record_stream`` on CUDA).

:class:`CudaStreamBackend` maps these onto real ``torch.cuda`` streams and events, with one
high-priority paging stream per device. :class:`CpuStreamBackend` runs everything at once, in
issue order, and keeps an :class:`LogEntry` list (which record, which stream, which waits) that
tests inspect.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

COMPUTE = "compute"
PAGING = "paging"
OFFLOAD = "offload"  # the CPU backend's offload streams: "offload<row_bytes>"


@dataclass
class LogEntry:
    """One step the CPU backend saw, in issue (= execution) order."""

    seq: int
    op: str  # "record" | "wait" | "launch" | "note"
    stream: str | None = None
    event: int | None = None  # event id (record / wait)
    kind: str | None = None  # launch kind ("stash", "reload", ...) or note kind
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class CpuEvent:
    """An event of the CPU backend: an id and the stream it was recorded on."""

    id: int
    stream: str
    what: str


class CpuStreamBackend:
    """Executes every launch immediately, in issue order; logs records, waits and launches.

    The logical streams are ``"compute"``, ``"paging"`` and ``"offload<row_bytes>"``. Events
    complete when they are recorded (the work before them already ran), so ``done()`` is always
    true. A launch given a ``pool=`` snapshots that pool's freelist head/tail before and after,
    so tests can check that freelist mutations happened in issue order.
    """

    def __init__(self):
        self.paging_stream = PAGING
        self.log: list[LogEntry] = []
        self._seq = itertools.count()
        self._event_ids = itertools.count()
        self._current = COMPUTE

    def compute_stream(self) -> str:
        return COMPUTE

    def offload_stream(self, row_bytes: int) -> str:
        return f"{OFFLOAD}{row_bytes}"

    def capturing(self) -> bool:
        return False

    def record(self, stream: str, what: str = "") -> CpuEvent:
        event = CpuEvent(next(self._event_ids), stream, what)
        self.log.append(LogEntry(next(self._seq), "record", stream, event.id, what))
        return event

    def wait(self, stream: str, event: CpuEvent, reason: str = "") -> None:
        self.log.append(
            LogEntry(next(self._seq), "wait", stream, event.id, reason, {"on": event.what})
        )

    def done(self, event: CpuEvent) -> bool:
        return True

    def launch(self, stream: str, kind: str, fn: Callable[[], None], **info) -> None:
        pool = info.pop("pool", None)
        if pool is not None:
            info["before"] = (pool.free_list_head.tolist(), pool.free_list_tail.tolist())
        previous, self._current = self._current, stream
        try:
            fn()
        finally:
            self._current = previous
        if pool is not None:
            info["after"] = (pool.free_list_head.tolist(), pool.free_list_tail.tolist())
        self.log.append(LogEntry(next(self._seq), "launch", stream, None, kind, info))

    @contextlib.contextmanager
    def scope(self, stream: str):
        """Launches inside run on ``stream`` (the CPU backend switches per launch anyway)."""
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        """CPU work runs at once: nothing can reuse memory early. Logged for tests."""
        self.log.append(LogEntry(next(self._seq), "keep_alive", stream, None, "tensor", {}))

    def note(self, kind: str, **info) -> None:
        """A scheduler milestone (commit, unpack, slot start) for the log; no work."""
        self.log.append(LogEntry(next(self._seq), "note", None, None, kind, info))

    def entries(self, op: str | None = None, kind: str | None = None) -> list[LogEntry]:
        return [
            e
            for e in self.log
            if (op is None or e.op == op) and (kind is None or e.kind == kind)
        ]


class CudaStreamBackend:
    """Real CUDA streams and events; one high-priority paging stream per device and one
    offload stream per offload pool, made on first use.

    Host cost matters here (every call is on the training step's critical host path): the
    device index is resolved once, ``compute_stream()`` asks CUDA for the current stream by
    index and returns one cached Python object per stream (the scheduler calls it at most once
    per public call), and ``scope`` makes the paging stream current once per group, setting
    and restoring it directly, so that ``launch`` inside it only calls ``fn``.

    Args:
        device: the CUDA device; the current device when omitted.
        priority: paging stream priority (lower is higher; clamped by CUDA to its range, so the
            default asks for the highest priority the device offers).
    """

    def __init__(self, device: torch.device | int | str | None = None, priority: int = -100):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaStreamBackend needs CUDA; use CpuStreamBackend on the CPU")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_index = self.device.index
        self.priority = priority
        self.paging_stream = torch.cuda.Stream(self.device, priority=priority)
        self._offload_streams: dict[int, torch.cuda.Stream] = {}
        self._scoped = None  # the stream a ``scope`` made current, if any
        # One Python object per CUDA stream, keyed by torch's (id, device, type) triple:
        # torch.cuda.current_stream builds a new one per call, several times per layer.
        self._streams: dict[tuple, torch.cuda.Stream] = {}
        self._current = getattr(torch._C, "_cuda_getCurrentStream", None)

    def compute_stream(self) -> torch.cuda.Stream:
        if self._current is None:  # a torch without the binding: the public call
            return torch.cuda.current_stream(self.device_index)
        key = self._current(self.device_index)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
        return stream

    def offload_stream(self, row_bytes: int) -> torch.cuda.Stream:
        """The stream of the offload pool for ``row_bytes`` (made on first use, which the
        scheduler makes outside any capture: see ``Transfers``)."""
        stream = self._offload_streams.get(row_bytes)
        if stream is None:
            stream = self._offload_streams[row_bytes] = torch.cuda.Stream(
                self.device, priority=self.priority)
        return stream

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def record(self, stream: torch.cuda.Stream, what: str = "") -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event, reason: str = "") -> None:
        stream.wait_event(event)

    def done(self, event: torch.cuda.Event) -> bool:
        return event.query()

    @contextlib.contextmanager
    def scope(self, stream):
        """Make ``stream`` current once for a group of launches (``None``: stay as is)."""
        if stream is None or stream is self._scoped:
            yield
            return
        previous, self._scoped = self._scoped, stream
        try:
            if torch.cuda.current_device() != self.device_index:
                with torch.cuda.stream(stream):  # it also switches and restores the device
                    yield
                return
            # Same device: set and restore the stream directly (what torch.cuda.stream does
            # there, without its two current_stream() objects per use).
            restore = self.compute_stream()
            torch.cuda.set_stream(stream)
            try:
                yield
            finally:
                torch.cuda.set_stream(restore)
        finally:
            self._scoped = previous

    def launch(self, stream, kind: str, fn: Callable[[], None], **info) -> None:
        if stream is None or stream is self._scoped:
            fn()
            return
        with torch.cuda.stream(stream):
            fn()

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        # The caching allocator frees a block for reuse on its allocation stream only; this
        # makes it also wait for ``stream``'s work queued so far when the tensor is freed.
        tensor.record_stream(stream)

    def note(self, kind: str, **info) -> None:
        pass


__all__ = [
    "COMPUTE", "OFFLOAD", "PAGING", "CpuEvent", "CpuStreamBackend", "CudaStreamBackend", "LogEntry",
]
