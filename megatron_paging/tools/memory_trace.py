"""What is allocated at the peak: replay a CUDA caching-allocator trace and group the live blocks.

``torch.cuda.memory._record_memory_history`` logs every allocation and free with its Python
stack; :func:`peak_breakdown` replays one such trace (``torch.cuda.memory._snapshot()``'s
``device_traces``), finds the moment the allocated bytes peak and groups the blocks alive then by
the first stack frame outside PyTorch (the model or paging code that asked for the memory).
The example's ``MEGATRON_PAGING_BENCH_MEMORY_ITER`` uses it to explain a step's peak.

By default bytes count from ``alloc`` until ``free_requested``, as the allocator's
``allocated_bytes`` statistic (``max_memory_allocated``) counts them: it drops a block when the
program frees it, even if another stream's recorded use (``record_stream``) keeps the block from
being reused until that stream's events complete. Such blocks are listed beside each group
("freed, awaiting another stream"); ``held=True`` counts them in (the memory held for the
program, which is what an out-of-memory error sees).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# Frames in these paths are not "who asked": the first frame outside them names the caller.
LIBRARY_PATHS = ("/torch/", "/contextlib.py", "/functools.py", "<frozen")


@dataclass(frozen=True)
class PeakGroup:
    site: str  # "file:line function" of the first frame outside PyTorch, or "<no stack>"
    bytes: int
    blocks: int
    # Blocks of this site already freed whose free waits on another stream's recorded use
    # (``record_stream``): the program dropped them, the allocator cannot reuse them yet. Part
    # of ``bytes`` only when the breakdown counts held memory (``held=True``).
    pending_free_bytes: int = 0
    # Where the first such block was freed (its free's first frame outside PyTorch).
    freed_at: str = ""
    streams: tuple[int, ...] = ()  # the streams these blocks were allocated on


@dataclass(frozen=True)
class PeakBreakdown:
    peak_bytes: int  # allocated (or held) bytes above the trace's start at the peak
    peak_index: int  # index of the trace entry that reached the peak (-1: empty trace)
    groups: list[PeakGroup]  # largest first
    # When the peak happened: the callers (outermost last) of the allocation that reached it.
    peak_callers: tuple[str, ...] = ()
    held: bool = False  # counted until free_completed (held) rather than free_requested


def caller_chain(frames: list[dict], depth: int = 4, path_parts: int = 2) -> tuple[str, ...]:
    """The first ``depth`` frames outside PyTorch, innermost first, as "path:line function"
    with the last ``path_parts`` components of the path (where in the step)."""
    chain = []
    for frame in frames or ():
        filename = frame.get("filename", "")
        if not any(part in filename for part in LIBRARY_PATHS):
            short = "/".join(filename.split("/")[-path_parts:])
            chain.append(f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}")
            if len(chain) == depth:
                break
    return tuple(chain)


def caller_site(frames: list[dict]) -> str:
    """Who asked for a block: its first frame outside PyTorch, or ``"<no stack>"``."""
    chain = caller_chain(frames, depth=1, path_parts=3)
    return chain[0] if chain else "<no stack>"


def peak_breakdown(trace: list[dict], held: bool = False) -> PeakBreakdown:
    """Replay ``trace`` (one device's entries, oldest first) and group the blocks live at its peak.

    ``held=False``: a block counts from ``alloc`` to ``free_requested``, as the allocator's
    ``allocated_bytes`` (``max_memory_allocated``) counts it. ``held=True``: until
    ``free_completed``, i.e. also while a block freed by the program waits for another stream's
    recorded use (``record_stream``) and cannot be reused: the memory the allocator holds for
    the program. Either way each group also says how much of its site waited so at the peak.

    Frees of blocks allocated before the trace began are ignored (they lower nothing the trace
    counted), so ``peak_bytes`` is relative to the allocated bytes when recording started.
    """
    ends = "free_completed" if held else "free_requested"
    live: dict[int, dict] = {}
    current = peak = 0
    peak_index = -1
    for i, entry in enumerate(trace):
        action = entry.get("action")
        if action == "alloc":
            live[entry["addr"]] = entry
            current += entry["size"]
            if current > peak:
                peak, peak_index = current, i
        elif action == ends and entry["addr"] in live:
            current -= live.pop(entry["addr"])["size"]
    # Second pass up to the peak: the live set at that moment, and the frees still waiting.
    live.clear()
    waiting: dict[int, tuple[dict, dict]] = {}  # addr -> (its alloc, its free request)
    for entry in trace[: peak_index + 1]:
        action, addr = entry.get("action"), entry.get("addr")
        if action == "alloc":
            live[addr] = entry
            waiting.pop(addr, None)
        elif action == "free_requested" and addr in live:
            waiting[addr] = (live[addr], entry)
            if not held:
                del live[addr]
        elif action == "free_completed":
            live.pop(addr, None)
            waiting.pop(addr, None)
    sizes: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    pending: dict[str, int] = defaultdict(int)
    freed_at: dict[str, str] = {}
    streams: dict[str, set] = defaultdict(set)
    for entry in live.values():
        site = caller_site(entry.get("frames", []))
        sizes[site] += entry["size"]
        counts[site] += 1
        streams[site].add(int(entry.get("stream", 0)))
    for alloc, free in waiting.values():
        site = caller_site(alloc.get("frames", []))
        pending[site] += alloc["size"]
        freed_at.setdefault(site, caller_site(free.get("frames", [])))
        streams[site].add(int(alloc.get("stream", 0)))
    groups = sorted(
        (
            PeakGroup(
                site,
                sizes[site],
                counts[site],
                pending[site],
                freed_at.get(site, ""),
                tuple(sorted(streams[site])),
            )
            for site in set(sizes) | set(pending)
        ),
        key=lambda g: (-g.bytes, -g.pending_free_bytes, g.site),
    )
    callers = caller_chain(trace[peak_index].get("frames", [])) if peak_index >= 0 else ()
    return PeakBreakdown(peak, peak_index, groups, callers, held)


def format_breakdown(breakdown: PeakBreakdown, top: int = 25, prefix: str = "") -> str:
    mib = 2**20
    kind = "held" if breakdown.held else "allocated"
    lines = [f"{prefix}{kind} peak above trace start: {breakdown.peak_bytes / mib:.1f} MiB"]
    if breakdown.peak_callers:
        lines.append(f"{prefix}peak reached in: " + " < ".join(breakdown.peak_callers))
    pending = sum(g.pending_free_bytes for g in breakdown.groups)
    if pending:
        part = "of it" if breakdown.held else "besides it"
        lines.append(
            f"{prefix}{part}, freed but awaiting another stream's use: {pending / mib:.1f} MiB"
        )
    for group in breakdown.groups[:top]:
        waiting = (
            f" ({group.pending_free_bytes / mib:.1f} MiB freed, awaiting another stream;"
            f" freed in {group.freed_at}; streams {','.join(map(str, group.streams))})"
            if group.pending_free_bytes
            else ""
        )
        lines.append(
            f"{prefix}{group.bytes / mib:10.1f} MiB {group.blocks:6d} blocks  {group.site}{waiting}"
        )
    rest = breakdown.groups[top:]
    if rest:
        lines.append(
            f"{prefix}{sum(g.bytes for g in rest) / mib:10.1f} MiB in {len(rest)} more sites"
        )
    return "\n".join(lines)


__all__ = [
    "PeakBreakdown",
    "PeakGroup",
    "caller_chain",
    "caller_site",
    "format_breakdown",
    "peak_breakdown",
]
