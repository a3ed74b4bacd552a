"""Shared test set-up: hypothesis profiles and fixtures.

Hypothesis profiles (choose with ``HYPOTHESIS_PROFILE``; default ``ci``):

* ``ci`` — derandomized (each test's examples follow from the test itself, so every run and
  every machine draws the same sequences), no example database, no deadline (the 2-core CI
  machine is shared), and a reproduction blob printed on failure.
* ``explore`` — random seeds, for hunting new failures locally; replay a failure with the
  ``@reproduce_failure`` blob it prints.

``PYTEST_SHARD=i/n`` keeps the i-th (0-based) of n shards of the collected tests, so n pytest
processes can share one GPU in one device call (``scripts/gpu_check.sh``'s ``PYTEST_SHARDS``).
Tests are dealt in collection order to the shard with the least estimated time so far; the
example's torchrun tests (40-135 s each on the H200, the rest well under 10 s) count as
:data:`SLOW_TEST_SECONDS`, so they spread evenly instead of piling into one shard (at
``ca915e0`` one shard of four held four of them, 313 s, and the call's limit cut another).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore",
    derandomize=False,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _shard() -> tuple[int, int] | None:
    spec = os.environ.get("PYTEST_SHARD", "")
    if not spec:
        return None
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise pytest.UsageError(f"PYTEST_SHARD={spec!r}: expected i/n with 0 <= i < n")
    return index, count


SLOW_TEST_FILES = ("test_example_pretrain.py",)
SLOW_TEST_SECONDS = 60.0


def _estimated_seconds(item) -> float:
    path = str(getattr(item, "nodeid", item)).split("::", 1)[0]
    return SLOW_TEST_SECONDS if path.endswith(SLOW_TEST_FILES) else 1.0


def pytest_collection_modifyitems(config, items):
    shard = _shard()
    if shard is None:
        return
    index, count = shard
    # Same items, same order in every process, so every shard computes the same deal.
    loads = [0.0] * count
    owner = []
    for item in items:
        target = min(range(count), key=lambda s: loads[s])
        loads[target] += _estimated_seconds(item)
        owner.append(target)
    kept = [item for item, s in zip(items, owner, strict=True) if s == index]
    dropped = [item for item, s in zip(items, owner, strict=True) if s != index]
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.fixture
def cpu_generator() -> torch.Generator:
    """A fixed-seed CPU generator, so tests that draw tensors are reproducible."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def one_cpu_thread():
    """One intra-op thread for the test: the models and tensors are tiny, and on a busy 2-core
    machine intra-op threads only contend. Modules opt in with ``pytestmark``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _FillSpy:
    """Records, for every ``torch.empty`` call while spying, whether the deterministic fill was
    on at that moment."""

    def __init__(self, monkeypatch):
        self._monkeypatch, self._real_empty, self.seen = monkeypatch, torch.empty, []

    def spy(self) -> None:
        def spying_empty(*args, **kwargs):
            self.seen.append(torch.utils.deterministic.fill_uninitialized_memory)
            return self._real_empty(*args, **kwargs)

        self._monkeypatch.setattr(torch, "empty", spying_empty)

    def unspy(self) -> None:
        self._monkeypatch.setattr(torch, "empty", self._real_empty)


@pytest.fixture
def deterministic_fill(monkeypatch):
    """Deterministic algorithms on for the test (Megatron's ``--deterministic-mode``: torch.empty
    NaN-fills every new buffer), restored afterwards; yields a :class:`_FillSpy`."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        yield _FillSpy(monkeypatch)
    finally:
        torch.use_deterministic_algorithms(was)
