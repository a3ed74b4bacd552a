"""benchmarks/kernels_ab.py on the CPU: the summary it prints and the trees it refuses."""

from __future__ import annotations

import pytest
from frontier_bench import load_script

ab = load_script("kernels_ab")


def test_summary_takes_each_trees_median_over_rounds_in_tree_order():
    rows = [
        {"tree": "this", "regime": "r", "arm": "cuda_stash", "host_ahead": False, "gbps": 10.0},
        {"tree": "this", "regime": "r", "arm": "cuda_stash", "host_ahead": False, "gbps": 12.0},
        {"tree": "this", "regime": "r", "arm": "cuda_stash", "host_ahead": False, "gbps": 20.0},
        {"tree": "main", "regime": "r", "arm": "cuda_stash", "host_ahead": False, "gbps": 9.0},
        {"tree": "main", "regime": "r", "arm": "cuda_chain", "host_ahead": True, "gbps": 1.0,
         "us_per_launch": 7.5},
    ]
    header, stash, chain = ab.summary(rows, ["main", "this"])
    assert header.split()[-2:] == ["main", "this"]
    assert stash.split()[-2:] == ["9.00", "12.00"]
    assert chain.split()[-2:] == ["7.50", "-"]  # the chain arms give µs per launch


@pytest.mark.parametrize(("argv", "says"), [
    (["--baseline", "/a/x", "--baseline", "/b/x"], "distinct names"),  # two trees, one tag
    (["--baseline", "/a/this", "--baseline", "/b/y"], "distinct names"),
    (["--baseline", "/a/x", "--baseline-commit", "1", "--baseline-commit", "2"],
     "more --baseline-commit"),
    ([], "--baseline DIR is required"),
])
def test_trees_without_distinct_tags_or_commits_are_refused(argv, says, capsys):
    """Refused before anything needs a GPU."""
    with pytest.raises(SystemExit) as done:
        ab.main(argv)
    assert done.value.code == 2
    assert says in capsys.readouterr().err
