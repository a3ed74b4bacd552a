"""Loads benchmarks/bench_frontier.py for the frontier tests (it is a script, not a package
module) and puts benchmarks/ on sys.path, where its `common` and `frontier` modules live;
``load_script`` loads the other benchmark scripts the same way."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"


def load_script(name: str):
    """benchmarks/``name``.py as a module, loaded once for every test file."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))  # common.py and the frontier/ package
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would register it
    spec.loader.exec_module(module)
    return module


bf = load_script("bench_frontier")  # main() and its glue; the rest is in benchmarks/frontier/

# The argv head a fake example script prints for the frontier's DRY_RUN query (a small MoE).
FAKE_BASE_ARGV = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 "
    "--seq-length 2048 --max-position-embeddings 2048 --swiglu "
    "--untie-embeddings-and-output-weights --num-experts 16 --moe-router-topk 2 "
    "--moe-ffn-hidden-size 1024 --moe-token-dispatcher-type flex "
    "--moe-expert-rank-capacity-factor 1.5 --micro-batch-size 1 --global-batch-size 8 "
    "--train-iters 20 --bf16 --vocab-size 32000"
)


def install_fake_example(tmp_path: Path, source: str, monkeypatch) -> Path:
    """Point the frontier's example script at a bash wrapper running the Python ``source``
    (``BASE`` in it: :data:`FAKE_BASE_ARGV`), and let the loaded drivers run without a GPU;
    returns the wrapper."""
    import textwrap

    fake = tmp_path / "fake_example.py"
    fake.write_text(f"BASE = {FAKE_BASE_ARGV!r}.split()\n" + source)
    script = tmp_path / "fake_run.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        exec "{sys.executable}" "{fake}" "$@"
        """))
    from frontier import arms as frontier_arms

    monkeypatch.setattr(frontier_arms, "SCRIPT", script)  # script_argv and Runner.run read it
    # The fake needs no GPU: the drivers' refusal without one is lifted for it.
    for name in ("bench_frontier", "bench_step_ratio"):
        if name in sys.modules:
            monkeypatch.setattr(sys.modules[name], "require_gpu", lambda benchmark: None)
    return script
