"""Page pools: their size for a buffer factor, and the factor a target overflow rate needs.

Sizing follows the calibration (:mod:`megatron_paging.runtime.calibration`): one pool per row byte
count; the device tier holds ``|factor| x`` the peak rows in flight, each record's rows rounded up
to whole pages, from the dispatcher's average-token hint (positive factor) or the first step's
measured live rows (negative). Megatron-Core's own manager keys its pools by (dtype, columns) and
scales the unrounded token peak (``paged_stash.py``: ``int(max_tokens x scale)`` rows).

The overflow rate is estimated by Monte-Carlo over steps with the router-load model of
:mod:`megatron_paging.tools.peer_load`: per step, every record of the rank (one per MoE layer and
chunk-microbatch) draws its live rows once; at each schedule moment (forward end, backward
start) the records in flight there hold their rows page-rounded; the step needs the most any
moment holds (:func:`step_needs`: a 0/1 moment x record incidence product), and overflows when
that exceeds the device tier. Vectorized in numpy, seeded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from megatron_paging.tools.peer_load import LognormalLoad, RouteShape, TraceLoad

# Below this many simulated overflows a rate is read off the fitted log-normal tail instead
# of the sample (an empirical quantile from fewer exceedances is mostly noise).
MIN_EXCEEDANCES = 10
STEP_CHUNK = 512  # steps simulated at once (bounds the Monte-Carlo's memory)
# Per-peer route counts are exact binomial draws up to this many per chunk of steps, their
# normal approximation above it (numpy's binomial draw costs several normal ones).
EXACT_DRAWS = 1 << 21


def page_rows(rows, page: int):
    """Rows rounded up to whole pages (numpy arrays or ints)."""
    return -(-rows // page) * page


@dataclass(frozen=True)
class PoolKey:
    """One pool: rows of ``row_bytes`` bytes, ``records`` of them in flight at the peak."""

    row_bytes: int
    records: int


def our_pool_bytes(keys, base_rows_per_record: int, factor: float, page: int) -> int:
    """Device (or host) tier bytes of megatron-paging's pools for ``|factor| x`` the in-flight
    records' page-rounded rows (``base_rows_per_record`` each); 0 for factor 0."""
    if factor == 0:
        return 0
    total = 0
    for key in keys:
        rows = key.records * page_rows(base_rows_per_record, page)
        rows = max(page, math.ceil(rows * abs(factor)))
        total += page_rows(rows, page) * key.row_bytes
    return total


def mcore_pool_bytes(keys, base_rows_per_record: int, factor: float, page: int) -> int:
    """Megatron-Core's manager: ``int(tokens in flight x |factor|)`` rows per key, in pages."""
    if factor == 0:
        return 0
    total = 0
    for key in keys:
        tokens = int(key.records * base_rows_per_record * abs(factor))
        total += page_rows(tokens, page) * key.row_bytes
    return total


@dataclass(frozen=True, eq=False)
class LoadModel:
    """What the Monte-Carlo needs about the routing of this rank's MoE layers.

    ``alive``: bool ``[moments, records]``, which records are in flight at each schedule moment
    (:func:`megatron_paging.plan.liveness.record_schedule`); None: all at one moment."""

    route: RouteShape  # tokens per peer, top-k, experts, EP size, this EP rank
    block: int  # rows one peer may send this rank (the static budget's per-pair block)
    page: int
    record_layers: tuple[int, ...]  # global layer number of every record of the step
    alive: np.ndarray | None = None


def step_needs(paged_rows: np.ndarray, alive: np.ndarray | None) -> np.ndarray:
    """Per step, the most rows the records in flight at any one moment hold: ``paged_rows`` is
    ``[steps, records]`` (page-rounded), ``alive`` ``[moments, records]`` (None: one moment
    with every record)."""
    if alive is None:
        return paged_rows.sum(axis=1)
    if alive.shape[0] == 0:
        return np.zeros(paged_rows.shape[0], dtype=np.int64)
    # float64 sums of integers below 2**53 are exact; BLAS does the product
    sums = paged_rows.astype(np.float64) @ alive.T.astype(np.float64)
    return sums.max(axis=1).astype(np.int64)


def simulate(load, model: LoadModel, steps: int, seed: int) -> np.ndarray:
    """Per simulated step, the page-rounded live rows the pool must hold at the step's fullest
    schedule moment (records drawn in chunks of :data:`STEP_CHUNK` steps: the draws depend on
    the seed, the step count and the records, not on ``alive``)."""
    out = np.empty(steps, dtype=np.int64)
    rng = np.random.default_rng(seed)
    for start in range(0, steps, STEP_CHUNK):
        n = min(STEP_CHUNK, steps - start)
        if isinstance(load, TraceLoad):
            live = _trace_live(load, model, n, rng)
        else:
            live = _lognormal_live(load, model, n, rng)
        out[start:start + n] = step_needs(page_rows(live, model.page), model.alive)
    return out


def _lognormal_live(load: LognormalLoad, model: LoadModel, n: int, rng) -> np.ndarray:
    """:class:`LognormalLoad` per record: the popularity of this rank's local experts drawn
    exactly, the other experts' total by its normal approximation (a sum of E - El lognormals),
    each peer's routes to this rank binomial (normal-approximated when large), capped at the
    block; summed over peers. Shape ``[n, records]``."""
    r = model.route
    records = len(model.record_layers)
    local = r.local_experts
    skew = load.skew
    w_local = np.exp(skew * rng.standard_normal((n, records, local))).sum(axis=-1)
    others = r.num_experts - local
    mean1, var1 = math.exp(skew**2 / 2), (math.exp(skew**2) - 1) * math.exp(skew**2)
    w_rest = others * mean1 + math.sqrt(others * var1) * rng.standard_normal((n, records))
    w_rest = np.maximum(w_rest, 1e-9)
    p = w_local / (w_local + w_rest)
    routes = r.tokens * r.topk
    if n * records * r.ep <= EXACT_DRAWS:
        counts = rng.binomial(routes, p[..., None], size=(n, records, r.ep))
    else:  # many peers x records: the binomial's normal limit (tokens x topk routes each),
        # in float32 and in place (the largest array of the model)
        p32 = p.astype(np.float32)[..., None]
        mean = routes * p32
        sd = np.sqrt(mean * (1 - p32))
        counts = rng.standard_normal((n, records, r.ep), dtype=np.float32)
        counts *= sd
        counts += mean
        np.rint(counts, out=counts)
        np.clip(counts, 0, min(routes, model.block), out=counts)
        return counts.sum(axis=-1, dtype=np.float64).astype(np.int64)
    return np.minimum(counts, model.block).sum(axis=-1).astype(np.int64)


def _trace_live(load: TraceLoad, model: LoadModel, n: int, rng) -> np.ndarray:
    """A recorded trace: each record takes a random recorded microbatch of its layer."""
    load.check(model.route)
    live = np.empty((n, len(model.record_layers)), dtype=np.int64)
    for j, layer in enumerate(model.record_layers):
        entries = load.trace["layers"].get(str(layer))
        if entries is None:
            raise ValueError(f"peer-load trace {load.path} has no layer {layer}")
        rows = np.asarray(entries, dtype=np.int64)  # [microbatch, peer, local expert]
        totals = np.minimum(rows.sum(axis=-1), model.block).sum(axis=-1)
        live[:, j] = totals[rng.integers(len(totals), size=n)]
    return live


@dataclass(frozen=True)
class FactorAdvice:
    """Buffer factors for one target overflow rate and their device (and host) memory."""

    rate: float
    cuda_factor: float  # positive: sized from the average-token hint (Megatron's default sign)
    cuda_bytes: int
    measured_factor: float  # negative flag value: sized from the first step's measured peak
    measured_bytes: int
    cpu_factor: float  # with the launch line's device factor: the host tier that reaches it
    cpu_bytes: int
    method: str  # "sample" or "log-normal tail"


@dataclass(frozen=True)
class PoolAdvice:
    load: str
    steps: int
    seed: int
    records_at_peak: int
    hint_rows: int  # page-rounded average-token hints in flight at the peak (the + base)
    capacity_rows: int  # page-rounded capacity in flight (no pool needs more)
    mean_ratio: float  # mean live rows in flight / hint rows
    max_ratio: float
    line_factor: float
    line_rate: float  # overflow rate of the launch line's device factor
    rows: tuple[FactorAdvice, ...]
    method: str


def _tail(samples: np.ndarray) -> tuple[float, float]:
    logs = np.log(np.maximum(samples, 1).astype(np.float64))
    return float(logs.mean()), float(logs.std())


def factor_for_rate(samples: np.ndarray, base: float, rate: float, measured: bool,
                    cap: float) -> tuple[float, str]:
    """The smallest factor whose overflow rate is at most ``rate`` (and its estimation method).

    ``measured``: the pool is sized from another step's peak (the first step's), so the ratio
    of two independent steps matters; else from the fixed ``base``. The sample quantile is used
    at ``max(rate, MIN_EXCEEDANCES / N)``, and never below the log-normal tail's value: the
    result grows monotonically as the rate shrinks."""
    n = len(samples)
    z = NormalDist().inv_cdf(1 - rate)
    mu, sigma = _tail(samples)
    if measured:
        ratios = samples / np.maximum(np.roll(samples, n // 2), 1)
        fit = math.exp(z * math.sqrt(2) * sigma)
    else:
        ratios = samples / base
        fit = math.exp(mu + z * sigma) / base
    sample_rate = max(rate, MIN_EXCEEDANCES / n)
    empirical = float(np.quantile(ratios, 1 - sample_rate))
    method = "sample" if rate >= MIN_EXCEEDANCES / n and empirical >= fit else "log-normal tail"
    return min(max(empirical, fit), cap), method


def overflow_rate(samples: np.ndarray, base: float, factor: float) -> float:
    """Estimated share of steps whose in-flight rows exceed ``factor x base``."""
    if factor < 0:  # sized from the first step: compare two independent steps
        ratios = samples / np.maximum(np.roll(samples, len(samples) // 2), 1)
        mu, sigma = 0.0, math.sqrt(2) * _tail(samples)[1]
        threshold = abs(factor)
    else:
        ratios = samples / base
        mu, sigma = _tail(samples)
        mu -= math.log(base)
        threshold = factor
    exceed = int(np.count_nonzero(ratios > threshold))
    if exceed >= MIN_EXCEEDANCES:
        return exceed / len(samples)
    if sigma == 0:
        return 0.0 if math.log(threshold) >= mu else 1.0
    return 1 - NormalDist(mu, sigma).cdf(math.log(threshold))


__all__ = [
    "FactorAdvice", "LoadModel", "MIN_EXCEEDANCES", "PoolAdvice", "PoolKey", "factor_for_rate",
    "mcore_pool_bytes", "our_pool_bytes", "overflow_rate", "page_rows", "simulate", "step_needs",
]
