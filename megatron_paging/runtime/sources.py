"""When the memory of a buffer being copied out (a stash or offload *source*) may be reused.

The scheduler hands every source whose copy it queued on the paging stream to a
:class:`SourceLifetimes` (docs/scheduler.md, "Copy-input lifetimes"). Eagerly, each copy's done
event is polled at later scheduler calls and the source dropped once the copy ended; offloaded
sources do not come here eagerly (``Transfers.hand_over_offload_sources`` gives them to the
allocator at once). A host ahead of the GPU sees a copy end late, though, and every layer it
committed meanwhile would keep its capacity-sized sources allocated beside the preallocated
pool. So when a layer's slot opens (its paged region begins), the sources of all but the newest
``stash_in_flight - 1`` committed stash groups go (``PagingConfig.stash_in_flight``): at most
that many layers' sources, the opening one's included, are allocated at once. What the host has
not seen end goes after a compute-stream wait on its copy, not a host wait: the memory follows
the stream order, the host keeps its lead, and the copy had the layer's work before the opening
(its attention block) to finish. Inside a CUDA-graph capture no event may be queried, so the compute
stream always waits on the copy, which orders every later reuse of the memory after it:

* a stash (an HBM copy, microseconds) when the next layer slot opens, as above, or at the next
  commit (with no bound: ``stash_in_flight=0``);
* an offload (a PCIe copy, milliseconds) only once ``offload_in_flight`` later groups of the
  same module name have been committed — the meaning of Megatron-Core's
  ``--fine-grained-offloading-max-inflight-offloads`` — so the copy overlaps that much forward
  compute instead of stalling the next group's commit;
* what a forward left of a module name once it passes a group of that name it keeps on the
  device (its last layer's, by Megatron-Core's margin: nothing of that name follows, and the
  copies had a layer of compute to finish), so they are gone before its loss needs memory;
* and, when a backward begins, every stash source still in flight (whichever forward left it:
  in 1F1B the forward just before this backward left its last layer's) and whatever the
  backward's own forward left of offloads — eagerly too, like the bound above: sources still
  in flight there would otherwise stay allocated through the backward, at its peak.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any


def _offload_name(handles) -> Any:
    """The module name of an offload group (its slot key is ``("offload", index, name)``), or
    None for a stash group."""
    first = handles[0]
    if first.offload is None:
        return None
    key = first.notes.get("layer")
    return key[-1] if isinstance(key, tuple) and key else key


@dataclass(eq=False)
class InFlight:
    """One committed group whose copy may still read its sources."""

    done: Any  # the copy's done event on the stream it ran on
    handles: list
    name: Any  # the offload group's module name; None for a stash group
    number: int  # how many groups of ``name`` were tracked before this one
    # storages freed with these sources (Megatron's forced releases under capture)
    freed_with: list = field(default_factory=list)


class SourceLifetimes:
    """The sources whose copies may still run, oldest first, and the rule that drops them."""

    def __init__(self, backend, offload_in_flight: int = 2, stash_in_flight: int = 0):
        self.backend = backend
        self.offload_in_flight = offload_in_flight
        self.stash_in_flight = stash_in_flight  # layers' stash sources allocated at once; 0: any
        self._entries: deque[InFlight] = deque()
        self._commits: dict[Any, int] = defaultdict(int)  # offload name -> groups tracked

    def __len__(self) -> int:
        return len(self._entries)

    def track(self, parts) -> None:
        """One commit's sources stay referenced until their copy is known over: ``parts`` is
        ``[(done, handles), ...]``, one per stream the commit's copies ran on (an offload group
        counts as one group of its name, however many streams it used)."""
        numbered: dict[Any, int] = {}
        for done, handles in parts:
            name = _offload_name(handles)
            if name is not None and name not in numbered:
                numbered[name] = self._commits[name]
                self._commits[name] += 1
            self._entries.append(InFlight(done, handles, name, numbered.get(name, 0)))

    def layer_opens(self, compute) -> None:
        """A layer's slot opens (its paged region, the experts, begins): only the newest
        ``stash_in_flight - 1`` committed stash groups keep their sources (this layer's make the
        bound); older ones go, those whose copy the host has not seen end after ``compute``
        waited on it (never a host wait). Records are made at the commit, so the slot's opening
        is the last point before the layer's own buffers (the fc1 output) are allocated. Offload
        groups keep their own rules. No bound with ``stash_in_flight=0``."""
        if not self.stash_in_flight or not self._entries:
            return
        self.poll()  # what is seen done goes without a wait
        stash = [e for e in self._entries if e.name is None]
        due = {id(e) for e in stash[: max(len(stash) - self.stash_in_flight + 1, 0)]}
        if due:
            self._release(compute, lambda entry: id(entry) in due)

    def free_with_sources(self, tensors) -> None:
        """Inside a capture: free each tensor's storage (``resize_(0)``) once no queued copy
        reads it: when the last tracked source sharing it is dropped (after the compute stream
        waited on its copy; eagerly the allocator's ``record_stream`` does this), or now if no
        tracked source shares it (its copy read a contiguous copy, or was waited on already)."""
        for tensor in tensors:
            pointer = tensor.untyped_storage().data_ptr()
            entry = next((e for e in reversed(self._entries) if any(
                h.source is not None and h.source.untyped_storage().data_ptr() == pointer
                for h in e.handles)), None)
            if entry is None:
                tensor.untyped_storage().resize_(0)
            else:
                entry.freed_with.append(tensor)

    def poll(self) -> None:
        """Eagerly: drop the sources whose copies ended (in order; never inside a capture)."""
        if self.backend.capturing():
            return  # no event queries inside a capture; the next commit releases
        while self._entries and self.backend.done(self._entries[0].done):
            entry = self._entries.popleft()
            _drop(entry.handles)
            self.free_with_sources(entry.freed_with)  # or with an older copy's source sharing it

    def release_captured(self, compute, current=()) -> None:
        """Inside a capture, after a commit tracked its sources (``current``: that commit's
        done events, one per stream it used): the compute stream waits on, then drops, every
        older stash source and every offload source beyond the ``offload_in_flight`` newest
        groups of its name (the committing one included). Eagerly nothing (``poll`` does it)."""
        if not self.backend.capturing():
            return
        self._release(compute, lambda entry: (
            all(entry.done is not done for done in current) if entry.name is None
            else self._commits[entry.name] - entry.number > self.offload_in_flight))

    def release_forward_of(self, compute, chunk: int, microbatch: int, name=None) -> None:
        """Every source the forward of ``(chunk, microbatch)`` left is waited on and dropped.
        With ``name``: only its offload sources of that module name (its window closed)."""
        self._release(compute, lambda entry: _left_by(entry, chunk, microbatch) and (
            name is None or entry.name == name))

    def backward_begins(self, chunk: int, microbatch: int) -> None:
        """When the backward of ``(chunk, microbatch)`` begins, every stash source still in
        flight goes now, eagerly too, and what its own forward left of offloads. A host ahead
        of the GPU has not seen the last stashes end, and polling alone would keep their
        capacity-sized sources allocated through the backward beside the reloads: in 1F1B the
        forward just before this backward leaves its last layer's (at DeepSeek-V3's backward
        peak one layer's x and fc1 output, 1.4 GiB; ``scale_owners_h100.json``). The compute
        stream's wait costs at most one layer's HBM copy, which had that layer's fc2 and
        combine to finish. Other forwards' offloads (PCIe copies, milliseconds) keep their
        own rules."""
        if not self._entries:
            return
        self.poll()  # what is seen done goes without a wait
        if self._entries:
            self._release(self.backend.compute_stream(), lambda entry: (
                entry.name is None or _left_by(entry, chunk, microbatch)))

    def close_offload_window(self, chunk: int, name, microbatch: int) -> None:
        """Inside a capture, when the forward of ``(chunk, microbatch)`` passed a group of
        module ``name`` that stays on the device: its offload sources of that name go now."""
        if self._entries and self.backend.capturing():
            self.release_forward_of(self.backend.compute_stream(), chunk, microbatch, name)

    def _release(self, compute, due) -> None:
        kept: deque[InFlight] = deque()
        freed = []
        for entry in self._entries:
            if not due(entry):
                kept.append(entry)
                continue
            self.backend.wait(compute, entry.done, "source-release")
            _drop(entry.handles)
            freed += entry.freed_with
        self._entries = kept
        # A storage another copy still in flight reads (the same tensor saved by an older
        # group) goes with that copy's source instead.
        self.free_with_sources(freed)

    def clear(self) -> None:
        """End of step (after the paging stream was joined): drop everything."""
        entries, self._entries = self._entries, deque()
        for entry in entries:
            _drop(entry.handles)
            self.free_with_sources(entry.freed_with)
        self._commits.clear()


def _left_by(entry: InFlight, chunk: int, microbatch: int) -> bool:
    notes = entry.handles[0].notes
    return notes.get("chunk") == chunk and notes.get("microbatch") == microbatch


def _drop(handles) -> None:
    for h in handles:
        h.source = None


__all__ = ["InFlight", "SourceLifetimes"]
