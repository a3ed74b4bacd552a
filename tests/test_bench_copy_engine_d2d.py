"""The copy-engine probe refuses to run without a GPU in one line (its numbers come from the
H200: benchmarks/results/copy_engine_d2d_*.json)."""

from __future__ import annotations

import pytest
import torch
from frontier_bench import load_script

bench = load_script("bench_copy_engine_d2d")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_stops_with_one_line():
    with pytest.raises(SystemExit, match="^error: bench_copy_engine_d2d needs a CUDA device$"):
        bench.main([])


def test_bad_arguments_are_refused_by_the_parser():
    with pytest.raises(SystemExit):
        bench.main(["--copy-mib", "many"])
