"""What EMULATED expert-parallel peers send one rank: rows per (peer, local expert).

Under Megatron's ``--fake-process-group`` every collective is a no-op, so what the other EP ranks
would send this rank is made up here (:mod:`megatron_paging.mcore.peers` puts it where the
all-to-all's output would be). Nothing here is measured on other GPUs. Two sources:

* :class:`LognormalLoad` (``lognormal:<skew>``): for every ``(step, layer, microbatch)`` each
  expert gets a popularity weight ``exp(skew * z)``, ``z ~ N(0, 1)`` drawn for that key, so hot
  experts change from microbatch to microbatch and layer to layer as a router's do; each peer then
  spreads its ``tokens x topk`` routes over the experts by a multinomial with those weights (its
  own draw, seeded by the key and the peer). ``skew = 0`` is uniform routing. The knob is chosen,
  not measured: a recorded trace is the measured counterpart.
* :class:`TraceLoad` (a ``.json`` path): a recorded per-rank trace, replayed as is.

Both cap what one peer sends this rank at the static dispatcher's per-pair budget (its block
rows), dropping from the last local expert first, as the sender's static dispatcher does.

Trace format (JSON): ``{"format": TRACE_FORMAT, "num_experts": E, "ep": P, "rank": r,
"tokens_per_peer": T, "topk": k, "source": "...", "layers": {"<layer>": [microbatch][peer]
[local expert] rows}}``; microbatches are replayed in order, wrapping around across steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACE_FORMAT = "megatron-paging peer-load trace v1"


def _seed(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in key]))


def cap_block(rows: np.ndarray, block: int) -> np.ndarray:
    """``rows`` per local expert with at most ``block`` in total, the last experts dropped first
    (the sender fills its block for this rank in local-expert order)."""
    kept = np.minimum(np.cumsum(rows), block)
    return np.diff(kept, prepend=0)


@dataclass(frozen=True)
class RouteShape:
    """What every peer routes: its tokens per microbatch, top-k, the experts and this rank's."""

    tokens: int
    topk: int
    num_experts: int
    ep: int
    rank: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep


@dataclass(frozen=True)
class LognormalLoad:
    """Expert popularity ``exp(skew * z)`` per ``(step, layer, microbatch)`` (module doc)."""

    skew: float
    seed: int = 0

    def name(self) -> str:
        return f"lognormal:{self.skew:g}"

    def rows(self, shape: RouteShape, step: int, layer: int, microbatch: int, peer: int
             ) -> np.ndarray:
        """Rows ``peer`` routes to each of this rank's local experts (before the block cap)."""
        weights = np.exp(self.skew * _seed(self.seed, 0, step, layer, microbatch).standard_normal(
            shape.num_experts))
        routes = _seed(self.seed, 1, step, layer, microbatch, peer).multinomial(
            shape.tokens * shape.topk, weights / weights.sum())
        first = shape.rank * shape.local_experts
        return routes[first:first + shape.local_experts]


@dataclass
class TraceLoad:
    """A recorded trace replayed as is (module doc)."""

    path: str
    trace: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not self.trace:
            self.trace = read_trace(self.path)

    def name(self) -> str:
        return f"trace:{Path(self.path).name}"

    def check(self, shape: RouteShape) -> None:
        """One ``ValueError`` line when the trace was recorded for another layout."""
        want = {"num_experts": shape.num_experts, "ep": shape.ep, "rank": shape.rank,
                "tokens_per_peer": shape.tokens, "topk": shape.topk}
        other = {k: self.trace[k] for k in want if self.trace[k] != want[k]}
        if other:
            raise ValueError(
                f"peer-load trace {self.path} was recorded for "
                + ", ".join(f"{k}={v}" for k, v in other.items())
                + "; this run has " + ", ".join(f"{k}={want[k]}" for k in other)
            )

    def rows(self, shape: RouteShape, step: int, layer: int, microbatch: int, peer: int
             ) -> np.ndarray:
        layers = self.trace["layers"]
        per_layer = layers.get(str(layer))
        if per_layer is None:
            raise ValueError(
                f"peer-load trace {self.path} has no layer {layer} (it has "
                f"{', '.join(sorted(layers, key=int))})"
            )
        # microbatches of a step are consecutive in the trace; the trace wraps around
        index = (step * self.trace["microbatches_per_step"] + microbatch) % len(per_layer)
        return np.asarray(per_layer[index][peer], dtype=np.int64)


def parse_load(spec: str, seed: int = 0):
    """``lognormal:<skew>`` or a path to a ``.json`` trace; ``ValueError`` says what is wrong."""
    if spec.startswith("lognormal:"):
        try:
            skew = float(spec.split(":", 1)[1])
        except ValueError:
            skew = math.nan
        if not (math.isfinite(skew) and skew >= 0):
            raise ValueError(f"{spec!r}: the skew must be a number >= 0, e.g. lognormal:0.3")
        return LognormalLoad(skew, seed)
    if spec.endswith(".json"):
        return TraceLoad(spec)
    raise ValueError(f"{spec!r}: expected lognormal:<skew> or a path to a .json trace")


def read_trace(path: str) -> dict:
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"peer-load trace {path}: {error}") from None
    if not isinstance(trace, dict) or trace.get("format") != TRACE_FORMAT:
        raise ValueError(f"peer-load trace {path}: not a {TRACE_FORMAT!r} file")
    missing = [k for k in ("num_experts", "ep", "rank", "tokens_per_peer", "topk",
                           "microbatches_per_step", "layers") if k not in trace]
    if missing:
        raise ValueError(f"peer-load trace {path}: missing {', '.join(missing)}")
    return trace


@dataclass
class TraceRecorder:
    """Records what a real router routes, as a per-rank trace of an emulated EP layout.

    With ``--micro-batch-size P`` on one GPU (EP = 1), sequence ``p`` of each microbatch plays
    EP peer ``p``'s tokens and the experts split into ``P`` contiguous groups of local experts:
    rank ``rank`` of that layout would receive, from peer ``p``, the routes of sequence ``p`` to
    its own group. Measured routing, a chosen grouping.
    """

    path: str
    peers: int
    rank: int = 0
    source: str = ""
    layers: dict = field(default_factory=dict)
    shape: dict = field(default_factory=dict)

    def record(self, layer: int, routing_map) -> None:
        """``routing_map``: ``[tokens, experts]`` bool of one training forward, tokens
        ``s``-major over the ``P`` sequences (Megatron's ``[s, b]`` flattening)."""
        tokens, experts = routing_map.shape
        if tokens % self.peers or experts % self.peers:
            raise ValueError(
                f"trace recording: {tokens} tokens and {experts} experts must split into "
                f"{self.peers} peers (--micro-batch-size)"
            )
        local = experts // self.peers
        per_peer = routing_map.reshape(tokens // self.peers, self.peers, experts).sum(0)
        rows = per_peer[:, self.rank * local:(self.rank + 1) * local]
        self.layers.setdefault(str(layer), []).append(rows.to("cpu").tolist())
        self.shape = {"num_experts": experts, "ep": self.peers, "rank": self.rank,
                      "tokens_per_peer": tokens // self.peers}

    def write(self, topk: int, microbatches_per_step: int) -> dict:
        trace = {"format": TRACE_FORMAT, **self.shape, "topk": topk,
                 "microbatches_per_step": microbatches_per_step, "source": self.source,
                 "layers": self.layers}
        Path(self.path).write_text(json.dumps(trace))
        return trace


__all__ = ["LognormalLoad", "RouteShape", "TRACE_FORMAT", "TraceLoad", "TraceRecorder",
           "cap_block", "parse_load", "read_trace"]
