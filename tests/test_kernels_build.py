"""CPU-side checks of the CUDA kernel package: the nvcc build, the grid bound, argument checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_paging.kernels import build, cuda_ops
from megatron_paging.pool import PagePool
from megatron_paging.record import PageRecord


def _toolkit_or_none():
    try:
        return build.find_cuda_home()
    except build.BuildError:
        return None


@pytest.mark.build
@pytest.mark.skipif(_toolkit_or_none() is None, reason="no CUDA toolkit (nvcc) on this machine")
@pytest.mark.skipif(torch.version.cuda is None, reason="torch is a CPU-only build")
def test_extension_builds_for_sm90_and_registers_ops():
    # One compile per source change; later runs find the cached build (ninja no-op).
    library = build.load("9.0")
    assert library.is_file() and library.parent == build.build_directory("9.0")
    stash_schema = str(torch.ops.megatron_paging.stash.default._schema)
    reload_schema = str(torch.ops.megatron_paging.reload.default._schema)
    assert "Tensor(d!) page_record" in stash_schema and "int max_ctas" in stash_schema
    assert "Tensor(a!) dst" in reload_schema and "Tensor(d!) free_list_tail" in reload_schema


def _import_with_max_ctas(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGATRON_PAGING_MAX_CTAS=value)
    code = "import megatron_paging.kernels as k; print(k.MAX_CTAS)"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("value", ["0", "-5", "many"])
def test_non_positive_max_ctas_is_rejected_at_import(value):
    result = _import_with_max_ctas(value)
    assert result.returncode != 0
    assert "MEGATRON_PAGING_MAX_CTAS must be a positive integer" in result.stderr
    assert repr(value) in result.stderr


def test_max_ctas_is_read_at_import():
    result = _import_with_max_ctas("7")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "7"


def test_resolve_arch():
    assert build.resolve_arch("9.0") == "9.0"
    assert build.resolve_arch("10.0+PTX") == "10.0"
    with pytest.raises(build.BuildError, match="arch must look like"):
        build.resolve_arch("sm_90")


def test_resolve_arch_without_gpu_or_arch_list_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(build.BuildError, match="pass --arch"):
        build.resolve_arch(None)


def test_missing_toolkit_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(build, "_DEFAULT_CUDA_HOME", str(tmp_path / "none"))
    with pytest.raises(build.BuildError, match="no CUDA toolkit found.*nvcc"):
        build.find_cuda_home()


def _cpu_case():
    pool = PagePool(row_bytes=8, page_size=4, num_cuda_pages=4)
    record = PageRecord.new(8, 8, 4, torch.tensor(3))
    return torch.zeros(8, 8, dtype=torch.uint8), record, pool


def test_cuda_wrapper_rejects_a_cpu_pool():
    src, record, pool = _cpu_case()
    with pytest.raises(ValueError, match="need a CUDA pool"):
        cuda_ops.stash(src, record, pool, max_ctas=64)


def test_cuda_wrapper_rejects_non_positive_max_ctas():
    src, record, pool = _cpu_case()
    pool.device = torch.device("cuda", 0)  # only the static checks run before any launch
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_ctas must be a positive integer"):
            cuda_ops.reload(src, record, pool, max_ctas=bad)
