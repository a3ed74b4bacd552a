"""The Nsight Compute profile script on CPU: reading ``ncu --page raw --csv`` (which op each
kernel is, which metrics are kept) and its start-up refusals. The profile itself needs a GPU
and ``ncu`` (``scripts/gpu_check.sh profile-kernels``)."""

from __future__ import annotations

import pytest
from frontier_bench import load_script

profile = load_script("profile_kernels")

RAW = "\n".join([
    "==PROF== Connected to process 1",
    '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","launch__grid_size",'
    '"sm__warps_active.avg"',
    '"","","us","Mbyte","","warp"',
    '"0","void ns::bulk_kernel<0, 8>(PagingArgs, Segments<8>)","240.00","352.40","132","1.0"',
    '"1","void ns::bulk_kernel<1, 8>(PagingArgs, Segments<8>)","236.00","352.38","132",""',
    '"2","void at::native::vectorized_elementwise_kernel<4, BitwiseOr>(int)","1,201.5","352.39",'
    '"1056","9"',
])


def test_raw_csv_names_each_kernels_op_and_keeps_the_chosen_metrics():
    kernels = profile.parse_raw_csv(RAW)
    assert [k["op"] for k in kernels] == ["stash", "reload", "streaming"]
    first = kernels[0]["metrics"]
    assert first["gpu__time_duration.sum"] == {"value": 240.0, "unit": "us"}
    assert first["dram__bytes_read.sum"]["unit"] == "Mbyte"
    assert "sm__warps_active.avg" not in first  # not a kept prefix
    assert "launch__grid_size" in kernels[1]["metrics"]
    assert kernels[2]["metrics"]["gpu__time_duration.sum"]["value"] == 1201.5  # thousands comma
    rows = profile.summary_rows([{"regime": "r", "kernels": kernels}])
    assert rows[0][:7] == ["r", "stash", 240.0, pytest.approx(352.40), None, None, 132.0]
    assert rows[0][7] == pytest.approx(1201.5 / 240.0)  # streaming time over the op's


def test_the_table_puts_every_value_in_one_unit_whatever_ncu_chose():
    kernel = {"op": "stash", "metrics": {
        "dram__bytes_write.sum": {"value": 639.488, "unit": "Kbyte"},
        "gpu__time_duration.sum": {"value": 1.5, "unit": "ms"}}}
    assert profile.metric(kernel, "dram__bytes_write.sum", per=1e6) == pytest.approx(0.639488)
    assert profile.metric(kernel, "gpu__time_duration.sum") == pytest.approx(1500.0)
    kernel["metrics"]["gpu__time_duration.sum"]["unit"] = "cycle"
    with pytest.raises(RuntimeError, match="unknown Nsight Compute unit 'cycle'"):
        profile.metric(kernel, "gpu__time_duration.sum")


def test_tile_kernels_are_named_by_their_template_argument_too():
    assert profile.kernel_op("void tile_kernel<1, 1024>(PagingArgs, Segments<1024>)") == "reload"
    assert profile.kernel_op("void tile_kernel<0, 8>(PagingArgs, Segments<8>)") == "stash"
    assert profile.kernel_op("void at::native::elementwise_kernel<128, 2, FillFunctor>") == "other"


def test_an_empty_report_is_an_error_not_an_empty_file():
    with pytest.raises(RuntimeError, match="no kernels"):
        profile.parse_raw_csv("==PROF== Disconnected\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["--regimes", "9"], "--regimes: indices"),
    (["--regimes", "5"], "host-spill regime"),
])
def test_bad_regimes_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_ncu_nothing_runs(monkeypatch, capsys):
    monkeypatch.setattr(profile.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit):
        profile.main(["--regimes", "0"])
    assert "`ncu` is not on PATH" in capsys.readouterr().err
