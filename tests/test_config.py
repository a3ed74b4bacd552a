"""PagingConfig: every field's validation (one-line ConfigError naming the field), ``replace``,
``from_env``, ``from_args`` (PagingArgs, the flags), ``grid_bound``, the choice lists that must
match the registries; and ``MEGATRON_PAGING_MAX_CTAS``, read when a config is built and never
at import (so importing, ``megatron-paging info`` and ``--help`` work with a bad value)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from megatron_paging import kernels
from megatron_paging.cli import main as cli_main
from megatron_paging.config import (
    DEFAULT_MAX_CTAS,
    KERNEL_BACKENDS,
    MAX_CTAS_ENV,
    MAX_GRID_BOUND,
    OVERFLOW_POLICIES,
    ConfigError,
    PagingArgs,
    PagingConfig,
    kernel_grid_bound,
    max_ctas_from_env,
    non_negative_int,
    positive_int,
)
from megatron_paging.overflow.policy import POLICIES, GrowPolicy, RerunPolicy, SkipPolicy

NAN, INF = math.nan, math.inf
# Every PagingConfig field -> values it must refuse, and the words its error must contain.
BAD = {
    "page_size": ([0, -1, 1.5, True, "4", None], "must be a positive integer"),
    "cuda_factor": ([NAN, INF, -INF, True, "1.1", None], "must be a finite number"),
    "host_factor": ([NAN, INF, -INF, False, "0", None], "must be a finite number"),
    "kernel_backend": (["triton", "CUDA", "", None, "auto "], "must be one of"),
    "max_ctas": ([0, -4, 2.0, True, "64"], "must be a positive integer"),
    "prefetch_distance": ([-1, 1.0, True, None, "1"], "must be a non-negative integer"),
    "overlap": ([1, 0, None, "yes"], "must be True or False"),
    "offload_streams": ([1, None, "no"], "must be True or False"),
    "overflow_policy": (["rerun", "abort", None, GrowPolicy], "must be an OverflowPolicy"),
    "offload_host_factor": ([NAN, INF, True, "1.25", None], "must be a finite number"),
    "offload_d2h_max_ctas": ([0, -1, 4.0, True, None], "must be a positive integer"),
    "offload_h2d_max_ctas": ([0, -1, 8.0, True, None], "must be a positive integer"),
    "offload_dma_prefix": ([NAN, INF, True, "1", None], "must be a finite number"),
    "offload_in_flight": ([-1, 2.0, True, None], "must be a non-negative integer"),
    "stash_in_flight": ([-1, 1.0, True, None, "1"], "must be a non-negative integer"),
    "pool_residency": (["auto", "", None, True], "must be one of persistent, step"),
    "hold_last_slot": ([0, 1, None, "yes"], "must be True or False"),
}
# Values at the edge of what each field accepts.
GOOD = {
    "page_size": [1, 4096],
    "cuda_factor": [1e-9, -1.10, 3],  # negative: always from the measured peak (MCore's sign)
    "host_factor": [0, 0.0, -0.5, 2],
    "kernel_backend": ["auto", "reference", "cuda", "tile", "bulk"],
    "max_ctas": [None, 1, 2**20, MAX_GRID_BOUND],
    "prefetch_distance": [0, 7],
    "overlap": [True, False],
    "offload_streams": [True, False],
    "overflow_policy": [RerunPolicy(), SkipPolicy(), GrowPolicy(growth_factor=2.0)],
    "offload_host_factor": [1, 1.0, 3.5],
    "offload_d2h_max_ctas": [1, 132, MAX_GRID_BOUND],
    "offload_h2d_max_ctas": [1, 132, MAX_GRID_BOUND],
    "offload_dma_prefix": [0, 0.0, 0.5, 1, 1.0],
    "offload_in_flight": [0, 2, 16],
    "stash_in_flight": [0, 1, 8],
    "pool_residency": ["persistent", "step"],
    "hold_last_slot": [True, False],
}


def bad_cases() -> list:
    return [
        pytest.param(name, value, words, id=f"{name}={value!r}")
        for name, (values, words) in BAD.items()
        for value in values
    ]


def test_the_tables_cover_every_field():
    fields = {f.name for f in dataclasses.fields(PagingConfig)}
    assert set(BAD) == fields and set(GOOD) == fields


@pytest.mark.parametrize(("name", "value", "words"), bad_cases())
def test_bad_field_is_a_one_line_error_naming_it(name, value, words):
    with pytest.raises(ConfigError) as excinfo:
        PagingConfig(**{name: value})
    error = excinfo.value
    assert isinstance(error, ValueError)  # callers that catch ValueError keep working
    assert error.field == name
    message = str(error)
    assert message.startswith(f"{name} ") and words in message, message
    assert repr(value) in message and "\n" not in message
    assert message == f"{error.field} {error.problem}"


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("cuda_factor", 0, "must be non-zero"),
        ("cuda_factor", 0.0, "must be non-zero"),
        ("cuda_factor", -0.0, "must be non-zero"),
        ("offload_host_factor", 0.99, "must be >= 1"),
        ("offload_dma_prefix", -0.1, r"must be in \[0, 1\]"),
        ("offload_dma_prefix", 1.01, r"must be in \[0, 1\]"),
        ("max_ctas", 2**31, "must be at most 2147483647"),
        ("offload_d2h_max_ctas", 2**31, "must be at most 2147483647"),
        ("offload_h2d_max_ctas", 2**31, "must be at most 2147483647"),
    ],
)
def test_range_errors_name_the_field(name, value, words):
    with pytest.raises(ConfigError, match=f"^{name} {words}") as excinfo:
        PagingConfig(**{name: value})
    assert excinfo.value.field == name and "\n" not in str(excinfo.value)


@pytest.mark.parametrize(
    ("name", "value"), [(n, v) for n, values in GOOD.items() for v in values]
)
def test_edge_values_are_accepted_as_given(name, value):
    config = PagingConfig(**{name: value})
    assert getattr(config, name) == value


def test_defaults_are_megatron_cores():
    config = PagingConfig()
    assert (config.page_size, config.cuda_factor, config.host_factor) == (64, 1.10, 0.0)
    assert (config.kernel_backend, config.max_ctas, config.overflow_policy) == (
        "auto", None, RerunPolicy())
    assert (config.prefetch_distance, config.overlap, config.hold_last_slot) == (1, True, False)


def test_kernel_backend_error_lists_the_choices():
    with pytest.raises(ConfigError) as excinfo:
        PagingConfig(kernel_backend="triton")
    assert str(excinfo.value) == (
        f"kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}; got 'triton'"
    )


def test_config_is_frozen():
    config = PagingConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.page_size = 8


# ----------------------------------------------------------------------------- replace


def test_replace_returns_a_validated_copy():
    config = PagingConfig(page_size=16, max_ctas=64)
    changed = config.replace(page_size=32, overlap=False)
    assert (changed.page_size, changed.overlap, changed.max_ctas) == (32, False, 64)
    assert (config.page_size, config.overlap) == (16, True)  # the original is untouched
    assert changed == PagingConfig(page_size=32, overlap=False, max_ctas=64)
    assert config.replace() == config and config.replace() is not config


@pytest.mark.parametrize(("name", "value"), [("page_size", 0), ("offload_host_factor", 0.5),
                                              ("kernel_backend", "triton"), ("max_ctas", 0)])
def test_replace_validates_again(name, value):
    with pytest.raises(ConfigError) as excinfo:
        PagingConfig().replace(**{name: value})
    assert excinfo.value.field == name


def test_replace_rejects_unknown_fields():
    with pytest.raises(TypeError, match="page_sise"):
        PagingConfig().replace(page_sise=8)


# ----------------------------------------------------------------------------- from_env


def test_from_env_reads_max_ctas():
    config = PagingConfig.from_env({MAX_CTAS_ENV: "96"}, page_size=8)
    assert (config.max_ctas, config.grid_bound, config.page_size) == (96, 96, 8)


def test_from_env_without_the_variable_keeps_the_default_bound():
    config = PagingConfig.from_env({}, overlap=False)
    assert config.max_ctas is None and config.grid_bound == DEFAULT_MAX_CTAS == 2048
    assert config.overlap is False


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(MAX_CTAS_ENV, " 12 ")
    assert PagingConfig.from_env().max_ctas == 12
    monkeypatch.delenv(MAX_CTAS_ENV)
    assert PagingConfig.from_env().max_ctas is None


def test_an_explicit_max_ctas_wins_and_the_environment_is_not_read():
    config = PagingConfig.from_env({MAX_CTAS_ENV: "many"}, max_ctas=5)
    assert config.max_ctas == 5


@pytest.mark.parametrize("raw", ["0", "-3", "many", "1.5", "", " ", "0x10", "2147483648"])
def test_from_env_bad_variable_is_a_one_line_error_naming_it(raw):
    with pytest.raises(ConfigError) as excinfo:
        PagingConfig.from_env({MAX_CTAS_ENV: raw})
    error = excinfo.value
    assert error.field == MAX_CTAS_ENV
    assert str(error).startswith(f"{MAX_CTAS_ENV} must be a positive integer")
    assert repr(raw) in str(error) and "\n" not in str(error)


def test_from_env_validates_the_other_fields():
    with pytest.raises(ConfigError) as excinfo:
        PagingConfig.from_env({MAX_CTAS_ENV: "8"}, page_size=0)
    assert excinfo.value.field == "page_size"


@pytest.mark.parametrize(("raw", "value"), [("1", 1), ("96", 96), (" 7\n", 7), ("+5", 5)])
def test_max_ctas_from_env_values(raw, value):
    assert max_ctas_from_env({MAX_CTAS_ENV: raw}) == value
    assert max_ctas_from_env({"OTHER": raw}) is None


# ----------------------------------------------------------------------------- PagingArgs


def test_from_args_takes_every_flag_that_is_a_config_field():
    args = PagingArgs(paging_overflow_policy="grow", paging_prefetch_distance=3,
                      paging_hold_last_slot=True, paging_offload_host_factor=2.0,
                      paging_recompute_expert_fc1=True, paging_offload_backend="paged")
    config = PagingConfig.from_args(args, page_size=32)
    assert (config.overflow_policy, config.prefetch_distance, config.hold_last_slot) == (
        GrowPolicy(), 3, True)
    assert (config.offload_host_factor, config.page_size) == (2.0, 32)
    # model and install options are not the engine's: they stay in PagingArgs
    names = {f.name for f in dataclasses.fields(PagingConfig)}
    assert "recompute_expert_fc1" not in names and "offload_backend" not in names
    assert PagingConfig.from_args(PagingArgs()) == PagingConfig()


def test_from_args_validates_and_names_the_config_field():
    with pytest.raises(ConfigError) as excinfo:
        PagingConfig.from_args(PagingArgs(paging_prefetch_distance=-1))
    assert excinfo.value.field == "prefetch_distance"
    with pytest.raises(ConfigError, match="overflow_policy must be one of rerun, skip, grow"):
        PagingConfig.from_args(PagingArgs(paging_overflow_policy="abort"))


def test_every_flag_is_named_paging():
    # Each one's help (its docstring) is checked on the built parser: test_mcore_flags.py.
    assert all(f.name.startswith("paging_") for f in dataclasses.fields(PagingArgs))


@pytest.mark.parametrize(("check", "bad", "good"), [
    (positive_int, [0, -1, 1.0, True, None], [1, 9]),
    (non_negative_int, [-1, 0.0, False, "0"], [0, 9]),
])
def test_int_checks_name_the_field(check, bad, good):
    for value in bad:
        with pytest.raises(ConfigError, match=r"^rows must be a (positive|non-negative) integer"):
            check("rows", value)
    assert [check("rows", v) for v in good] == good


# ----------------------------------------------------------------------------- registries


def test_grid_bound():
    assert PagingConfig().grid_bound == DEFAULT_MAX_CTAS
    assert PagingConfig(max_ctas=1).grid_bound == 1
    assert PagingConfig(max_ctas=4096).grid_bound == 4096


def test_kernel_grid_bound_defaults_and_names_the_field():
    assert kernel_grid_bound(None) == DEFAULT_MAX_CTAS
    assert kernel_grid_bound(MAX_GRID_BOUND) == MAX_GRID_BOUND == 2**31 - 1
    for bad in (0, -1, 2.5, True, "64", 2**31):
        with pytest.raises(ConfigError) as excinfo:
            kernel_grid_bound(bad, "grid")
        assert excinfo.value.field == "grid"


def test_choices_match_the_registries():
    assert set(KERNEL_BACKENDS) == {"auto", *kernels.REGISTRY}
    assert set(OVERFLOW_POLICIES) == set(POLICIES) == {"rerun", "skip", "grow"}


# ----------------------------------------------------------------------------- environment


def _run(value: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    """A fresh interpreter with ``MEGATRON_PAGING_MAX_CTAS=value``."""
    env = dict(os.environ, **{MAX_CTAS_ENV: value})
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=cwd)


IMPORTS = "\n".join([
    "import megatron_paging, megatron_paging.kernels, megatron_paging.kernels.cuda_ops",
    "import megatron_paging.kernels.reference, megatron_paging.kernels.build",
    "import megatron_paging.config, megatron_paging.env, megatron_paging.runtime.engine",
    "import megatron_paging.runtime.context, megatron_paging.runtime.scheduler",
    "import megatron_paging.runtime.calibration",
    "import megatron_paging.cli, megatron_paging.demo.cli",
    "from megatron_paging.cli import main",
    "raise SystemExit(main(['info']))",
])


def test_import_and_info_work_with_a_bad_value():
    """One fresh interpreter: every runtime module imports, then ``megatron-paging info``."""
    result = _run("many", "-c", IMPORTS)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(MAX_CTAS_ENV)]
    assert len(lines) == 1, result.stdout
    shown = lines[0][len(MAX_CTAS_ENV):].strip()
    assert shown == f"invalid: 'many' ({_env_error('many').problem})"


def _env_error(raw: str) -> ConfigError:
    with pytest.raises(ConfigError) as excinfo:
        max_ctas_from_env({MAX_CTAS_ENV: raw})
    return excinfo.value


def test_info_shows_a_good_value_and_the_default(monkeypatch, capsys):
    for value in ("96", None, "0"):
        if value is None:
            monkeypatch.delenv(MAX_CTAS_ENV)
        else:
            monkeypatch.setenv(MAX_CTAS_ENV, value)
        assert cli_main(["info"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(MAX_CTAS_ENV)]
    assert [row.split(None, 1)[1] for row in rows] == [
        "96", f"{DEFAULT_MAX_CTAS} (default)", f"invalid: '0' ({_env_error('0').problem})",
    ]


def test_demo_with_a_bad_value_exits_2_with_one_line(tmp_path):
    """The real command line, in a fresh interpreter: exit 2, one stderr line naming the
    variable and its value, no traceback, and nothing trained (no plot written)."""
    plot = tmp_path / "demo.png"
    result = _run("-7", "-m", "megatron_paging.cli", "demo", "--plot", str(plot), cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert MAX_CTAS_ENV in lines[0] and "'-7'" in lines[0] and lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr and not plot.exists()
    assert "TinyMoE demo" not in result.stdout  # stopped before the run began


def test_demo_in_process_with_a_bad_value(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(MAX_CTAS_ENV, "lots")
    assert cli_main(["demo", "--schedule", "none", "--plot", str(tmp_path / "p.png")]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {_env_error('lots')}\n"
    assert captured.out == ""


def test_demo_help_works_with_a_bad_value(monkeypatch, capsys):
    monkeypatch.setenv(MAX_CTAS_ENV, "0")
    with pytest.raises(SystemExit) as excinfo:
        cli_main(["demo", "--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megatron-paging demo") and "--kernel-backend" in out
