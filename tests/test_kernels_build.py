"""CPU-side checks of the CUDA kernel package: the nvcc build (the extension module's ``copy``
and its ``Pool`` / ``Layout`` handle factories), the toolkit and arch look-ups, and the wrapper's
checks that run before anything is built or launched. (``MEGATRON_PAGING_MAX_CTAS``:
test_config.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_paging.kernels import build, cuda_ops
from megatron_paging.pages.pool import INVALID_LIVE_COUNT, INVALID_RELOAD, PagePool
from megatron_paging.pages.record import (
    RECORD_EMPTY,
    RECORD_RELOADED,
    RECORD_STASHED,
    PageRecord,
    RecordLayout,
)


def _toolkit_or_none():
    try:
        return build.find_cuda_home()
    except build.BuildError:
        return None


pytestmark = pytest.mark.long_cpu  # the cold nvcc build, over a minute: started first

needs_build = [
    pytest.mark.build,
    pytest.mark.skipif(_toolkit_or_none() is None, reason="no CUDA toolkit (nvcc) on this machine"),
    pytest.mark.skipif(torch.version.cuda is None, reason="torch is a CPU-only build"),
]


@pytest.fixture(scope="module")
def extension():
    # One compile per source change; later runs find the cached build (ninja no-op).
    return build.load("9.0")


def _apply(marks):
    def decorate(fn):
        for mark in reversed(marks):
            fn = mark(fn)
        return fn

    return decorate


@_apply(needs_build)
def test_extension_builds_for_sm90_and_exposes_copy_and_the_handles(extension):
    library = build.library_path(extension)
    assert library.is_file() and library.parent == build.build_directory("9.0")
    assert extension.__name__ == build.EXTENSION_NAME
    for name in ("copy", "bulk_supported", "make_pool", "make_layout", "constants"):
        assert hasattr(extension, name), name


@_apply(needs_build)
def test_extension_and_wrapper_agree_on_paths_and_constants(extension):
    assert extension.constants() == {
        "tile": cuda_ops.TILE, "bulk": cuda_ops.BULK, "record_empty": RECORD_EMPTY,
        "record_stashed": RECORD_STASHED, "record_reloaded": RECORD_RELOADED,
        "invalid_live_count": INVALID_LIVE_COUNT, "invalid_reload": INVALID_RELOAD,
        "max_segments": 1024,
    }


@_apply(needs_build)
@pytest.mark.parametrize(
    "segments", [None, [(0, 260), (260, 0), (270, 17), (290, 10)], [(5, 0)],
                 [(i, 1) for i in range(300)]],
    ids=["one", "four", "empty", "300"],
)
def test_layout_handles_of_valid_layouts_are_accepted(extension, segments):
    """Every layout RecordLayout.new accepts passes the handle's own (C++) validation."""
    layout = RecordLayout.new(300, 224, 16, segments)
    handle = cuda_ops.layout_handle(layout)
    assert layout.kernel_handle is handle and cuda_ops.layout_handle(layout) is handle


BAD_TABLES = {
    "slot": ((10, 8, 4, [0], [10], [1]), "slot_offsets\\[0\\] is 1, expected 0"),
    "overlap": ((10, 8, 4, [0, 3], [4, 4], [0, 1]), "sorted and disjoint \\(segment 1\\)"),
    "past_end": ((10, 8, 4, [0], [11], [0]), "segments end at row 11"),
    "none": ((10, 8, 4, [], [], []), "1 to 1024 segments, got 0"),
    "too_many": ((1025, 1, 1, list(range(1025)), [1] * 1025, list(range(1025))), "got 1025"),
    "lengths": ((10, 8, 4, [0], [10], []), "differ in length"),
    "capacity": ((0, 8, 4, [0], [0], [0]), "must be positive"),
}
REFUSE_IN_CHILD = """
import json, sys
from megatron_paging.kernels import build
extension = build.load("9.0")
for name, args in json.loads(sys.argv[1]).items():
    handle, problem = extension.make_layout(*args)
    print(json.dumps([name, handle is None, problem]), flush=True)
"""


@_apply(needs_build)
def test_layout_class_refuses_bad_tables(extension):
    # In a child process: a crash on this path (seen once on the GPU machine's toolchain) fails
    # this test with its signal instead of taking every later test down with it.
    cases = {name: args for name, (args, _) in BAD_TABLES.items()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, "-c", REFUSE_IN_CHILD, json.dumps(cases)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = {}
    for line in result.stdout.splitlines():
        if line.startswith("["):
            name, refused, problem = json.loads(line)
            seen[name] = (refused, problem)
    assert seen.keys() == BAD_TABLES.keys()
    for name, (_, words) in BAD_TABLES.items():
        refused, problem = seen[name]
        assert refused and re.search(words, problem), (name, problem)
        assert problem.startswith("megatron_paging: ") and "\n" not in problem


@_apply(needs_build)
def test_pool_class_needs_a_cuda_pool(extension):
    pool = PagePool(8, 4, 2)
    handle, problem = extension.make_pool(
        pool.cuda_pages, pool.host_pages, pool.free_list_cuda, pool.free_list_host,
        pool.free_list_head, pool.free_list_tail, pool.free_list_capacity,
        pool.flags.values, pool.stashes_after_overflow, pool.kernel_done_counter, 4, 8,
    )
    assert handle is None and problem == "megatron_paging: cuda_pages must be a CUDA tensor"


def test_every_source_is_listed_and_the_paths_are_named():
    assert cuda_ops.PATHS == {"tile": cuda_ops.TILE, "bulk": cuda_ops.BULK}
    # Every source and header is listed, so that an edit of any of them rebuilds.
    assert set(build.SOURCES) | set(build.HEADERS) == set(build.CSRC.glob("*.[ch]*"))


def test_copy_kernels_wait_for_the_previous_kernel_before_touching_memory():
    """Launched as programmatic dependents, the copy kernels may start before the previous kernel
    on the stream has finished: each waits before its first global-memory access (the ring
    state), and no launch bypasses the programmatic launch."""
    for name in ("paging_tile.cu", "paging_bulk.cu"):
        source = (build.CSRC / name).read_text()
        kernel = source[source.index("__global__"):]
        assert kernel.index("device::wait_for_previous_kernel();") < kernel.index(
            "device::read_state"), name
        assert "<<<" not in source and "launch_after_previous<" in source, name


def test_resolve_arch():
    assert build.resolve_arch("9.0") == "9.0"
    assert build.resolve_arch("10.0+PTX") == "10.0"
    assert build.resolve_arch("9.0a") == "9.0"
    with pytest.raises(build.BuildError, match="arch must look like"):
        build.resolve_arch("sm_90")


def test_resolve_arch_from_the_arch_list(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0;10.0")
    assert build.resolve_arch(None) == "9.0"
    assert build.build_directory("9.0").name == "sm90"


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


def test_a_lock_left_by_a_stopped_build_is_removed_not_waited_on(monkeypatch, tmp_path, capsys):
    """torch's build lock is a plain file a killed build leaves behind (every later build then
    waits forever); under our OS lock no other build of ours runs, so it is stale and goes."""
    (tmp_path / "lock").write_text("")
    library = tmp_path / "megatron_paging_kernels.so"
    library.write_text("")
    monkeypatch.setattr(build, "build_directory", lambda arch: tmp_path)
    monkeypatch.setattr(build, "_check_toolchain", lambda: tmp_path)
    seen = []

    def fake_jit_load(cpp_extension, build_dir, cc, verbose):
        seen.append((tmp_path / "lock").exists())  # torch would wait on it here
        return _Module(library)

    monkeypatch.setattr(build, "_jit_load", fake_jit_load)
    monkeypatch.delitem(sys.modules, build.EXTENSION_NAME, raising=False)
    assert build.load("9.0").__file__ == str(library)
    assert seen == [False]
    assert "left by a build that was stopped" in capsys.readouterr().err
    build.load("9.0")  # no stale lock now: nothing said
    assert seen == [False, False] and capsys.readouterr().err == ""


class _Module:
    def __init__(self, library):
        self.__file__ = str(library)


# ----------------------------------------------------------------------------- wrapper checks


def _cpu_case():
    pool = PagePool(row_bytes=8, page_size=4, num_cuda_pages=4)
    record = PageRecord.new(8, 8, 4, torch.tensor(3))
    return torch.zeros(8, 8, dtype=torch.uint8), record, pool


@pytest.fixture
def no_extension(monkeypatch):
    """The checks below must refuse before the extension is built or called."""

    def refuse():
        raise AssertionError("the extension was asked for")

    monkeypatch.setattr(cuda_ops, "library", refuse)


def test_cuda_wrapper_rejects_a_cpu_pool(no_extension):
    _, _, pool = _cpu_case()
    with pytest.raises(ValueError, match="the CUDA paging kernels need a CUDA pool, got one on"):
        cuda_ops.pool_handle(pool)
    assert pool.kernel_handle is None
    cuda_ops.prepare([pool])  # prepare() skips pools that are not on a CUDA device
    assert pool.kernel_handle is None


@pytest.mark.parametrize("reload", [False, True])
def test_cuda_wrapper_hands_each_value_to_the_launch_by_name(monkeypatch, reload):
    """The launch takes keywords (the extension checks their names at every call)."""
    src, record, pool = _cpu_case()
    calls = []

    class Library:
        def copy(self, **arguments):
            calls.append(arguments)
            return ""

    monkeypatch.setattr(cuda_ops, "library", Library)
    monkeypatch.setattr(cuda_ops, "pool_handle", lambda p: ("pool", p))
    monkeypatch.setattr(cuda_ops, "layout_handle", lambda layout: ("layout", layout))
    cuda_ops.copy(reload, src, record, pool, 96, "tile")
    assert calls == [dict(
        reload=reload, user=src, pool=("pool", pool), layout=("layout", record.layout),
        live_rows=record.live_rows, page_record=record.page_record,
        spilled_to_host=record.spilled_to_host, record_state=record.state,
        path=cuda_ops.TILE, max_ctas=96)]


def test_cuda_wrapper_runs_the_shared_checks_first(no_extension):
    src, record, pool = _cpu_case()
    with pytest.raises(ValueError, match="stash source holds 56 bytes"):
        cuda_ops.copy(False, src[:7], record, pool, 64)
    with pytest.raises(ValueError, match="reload destination must be contiguous"):
        cuda_ops.copy(True, torch.zeros(8, 16, dtype=torch.uint8)[:, ::2], record, pool, 64)


@pytest.mark.parametrize("name", ["bulk-16k", "bulk-contig", "bulk-dyn", "auto-bulk"])
def test_only_tile_and_bulk_can_be_forced(no_extension, name):
    src, record, _ = _cpu_case()
    with pytest.raises(ValueError, match=r"one of \('tile', 'bulk'\), got '" + name):
        cuda_ops.choose_path(src, record, name)
