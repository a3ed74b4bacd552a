"""Shared test set-up: hypothesis profiles and fixtures.

Hypothesis profiles (choose with ``HYPOTHESIS_PROFILE``; default ``ci``):

* ``ci`` — derandomized (each test's examples follow from the test itself, so every run and
  every machine draws the same sequences), no example database, no deadline (the 2-core CI
  machine is shared), and a reproduction blob printed on failure.
* ``explore`` — random seeds, for hunting new failures locally; replay a failure with the
  ``@reproduce_failure`` blob it prints.
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
