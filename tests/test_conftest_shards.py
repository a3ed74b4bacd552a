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


def test_no_shard_keeps_everything(monkeypatch):
    monkeypatch.delenv("PYTEST_SHARD", raising=False)
    items = ["a", "b"]
    conftest.pytest_collection_modifyitems(SimpleNamespace(hook=None), items)
    assert items == ["a", "b"]


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "a/b", "1", "0/0"])
def test_a_bad_shard_is_a_usage_error(monkeypatch, spec):
    with pytest.raises(pytest.UsageError, match="PYTEST_SHARD"):
        _shard(monkeypatch, spec, ["t"])
