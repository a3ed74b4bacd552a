"""Shared test set-up: hypothesis profiles and fixtures.

Hypothesis profiles (choose with ``HYPOTHESIS_PROFILE``; default ``ci``):

* ``ci`` — derandomized (each test's examples follow from the test itself, so every run and
  every machine draws the same sequences), no example database, no deadline (the 2-core CI
  machine is shared), and a reproduction blob printed on failure.
* ``explore`` — random seeds, for hunting new failures locally; replay a failure with the
  ``@reproduce_failure`` blob it prints.

Parallel runs use pytest-xdist (``make test PYTEST_WORKERS=2`` runs ``-n 2 --dist loadfile``).
Keep whole files on one worker: ``test_kernels_reference.py``'s ``test_example_budget`` counts
the examples that its file's ``@given`` tests ran in the same process (split over workers, it
skips), and the ``tests/test_mcore_*.py`` files start their gloo group once per module. Each
worker gets its share of the CPUs as torch intra-op threads (1 with 2 workers on 2 cores): more
threads than cores only contend.
"""

from __future__ import annotations

import os

import pytest
import torch
from cuda_twin import needs_sm90, require_bulk
from hypothesis import HealthCheck, settings

pytest_plugins = ["suite_stream"]  # PAGING_TEST_STREAM, and xdist workers that exit

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


def _share_cpus_between_xdist_workers() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cpus or 1) // workers))


_share_cpus_between_xdist_workers()


def pytest_collection_modifyitems(config, items):
    """Tests that train a Megatron model (minutes each) go first, then the files marked
    ``long_cpu``, keeping the order otherwise: the GPU suite hands tests out one at a time
    (gpu_check.sh: --dist load --maxschedchunk 1) and ``make test`` whole files in collection
    order (--dist loadfile --no-loadscope-reorder), so the long ones start on separate workers
    at once instead of one of them ending the run."""
    items.sort(key=lambda item: (item.get_closest_marker("training_run") is None,
                                 item.get_closest_marker("long_cpu") is None))


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


@pytest.fixture(params=["tile", pytest.param("bulk", marks=needs_sm90)])
def path(request) -> str:
    """The kernel backend that forces one CUDA copy path (the GPU kernel tests)."""
    if request.param == "bulk":
        require_bulk()
    return request.param
