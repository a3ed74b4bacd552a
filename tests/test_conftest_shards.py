"""tests/conftest.py's PYTEST_SHARD=i/n: the shards partition the collected tests, and a bad value
is a usage error naming the variable."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
import pytest


def _shard(monkeypatch, spec, items):
    monkeypatch.setenv("PYTEST_SHARD", spec)
    deselected = []
    hook = SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items))
    config = SimpleNamespace(hook=hook)
    kept = list(items)
    conftest.pytest_collection_modifyitems(config, kept)
    return kept, deselected


def test_shards_partition_the_collected_tests(monkeypatch):
    items = [f"test_{i}" for i in range(10)]
    kept = [_shard(monkeypatch, f"{i}/3", items) for i in range(3)]
    assert kept[0][0] == ["test_0", "test_3", "test_6", "test_9"]
    assert sorted(sum((k for k, _ in kept), [])) == sorted(items)
    for shard_kept, shard_deselected in kept:
        assert sorted(shard_kept + shard_deselected) == sorted(items)


def test_slow_tests_spread_over_the_shards(monkeypatch):
    """The example's torchrun tests, collected next to each other, land in different shards,
    and the light tests fill the shards that have fewer of them."""
    slow = [f"tests/test_example_pretrain.py::test_{i}" for i in range(6)]
    light = [f"tests/test_kernels.py::test_{i}" for i in range(30)]
    items = light[:10] + slow + light[10:]
    kept = [_shard(monkeypatch, f"{i}/4", items)[0] for i in range(4)]
    per_shard = [sum(1 for t in k if t in slow) for k in kept]
    assert sorted(per_shard) == [1, 1, 2, 2]
    assert sorted(sum(kept, [])) == sorted(items)
    loads = [60 * n + sum(1 for t in k if t in light) for n, k in zip(per_shard, kept,
                                                                      strict=True)]
    assert max(loads) - min(loads) <= 60


def test_no_shard_keeps_everything(monkeypatch):
    monkeypatch.delenv("PYTEST_SHARD", raising=False)
    items = ["a", "b"]
    conftest.pytest_collection_modifyitems(SimpleNamespace(hook=None), items)
    assert items == ["a", "b"]


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "a/b", "1", "0/0"])
def test_a_bad_shard_is_a_usage_error(monkeypatch, spec):
    with pytest.raises(pytest.UsageError, match="PYTEST_SHARD"):
        _shard(monkeypatch, spec, ["t"])
