"""Golden values of emulated ranks: a distributed regression for one rank on one GPU.

Each layout below is one rank of a larger Megatron job run under ``--fake-process-group``
(emulated EP and PP peers, docs/scale.md) in deterministic mode, paged. Its golden file
``tests/golden/<layout>.json`` keeps what a correct run gives: every microbatch loss and every
step's gradient checksum (float.hex, compared exactly) and the per-iteration whole-step and
forward-backward peaks (compared within 1%), with the GPU, date and commit that made it. A fresh
run is compared against it, the way Megatron's functional tests keep golden values::

    python tests/golden_values.py check [LAYOUT ...]     # exit 1 on a mismatch, 0 when equal
    python tests/golden_values.py update [LAYOUT ...]    # write new golden files

Exact values hold for one kind of GPU (kernels and their order may differ on another), so each
GPU kind has its own file, ``tests/golden/<layout>.<gpu>.json``; on a GPU without one the check
is refused and the GPU test skips, naming the command that makes it.

Runs pin Inductor's pointwise autotuning off (``MEGATRON_PAGING_BENCH_NO_AUTOTUNE=1``): its
benchmark allocates an L2-sized buffer only for kernels missing from Inductor's on-disk cache, so
the last-stage layout's steps 1 and 3 peaked at 137.8 and 142.1 MiB with a cold cache and at 89.8
and 94.9 with a warm one, load on the GPU or not (measured on H100:
``benchmarks/results/golden_autotune_h100.json``). With it off, files written and checked on a
busy GPU, from a cold cache, agree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_scale import read_loss_log, read_report  # noqa: E402

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
PEAK_TOLERANCE = 0.01
STEP_MEMORY = re.compile(
    r"step-memory iteration=(\d+) peak_allocated_mib=([\d.]+) fb_peak_allocated_mib=([\d.]+)")
# The monitor's lines for a step it discards (and the policy reruns, skips or grows after).
DISCARDED = {"over_budget": re.compile(r"step (\d+) dropped tokens in MoE dispatch"),
             "pool_overflow": re.compile(r"overflow at rank \d+ step (\d+)")}

SMALL = (
    "--hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 512 --moe-ffn-hidden-size 256 "
    "--seq-length 256 --max-position-embeddings 256 --vocab-size 1024 --deterministic-mode "
    "--expert-model-parallel-size 8 --pipeline-model-parallel-size 2 --num-experts 16 "
    "--num-layers 4 --global-batch-size 32 --use-distributed-optimizer --fake-process-group "
    "--train-iters 4"
).split()
MLA = (
    "--multi-latent-attention --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 64 "
    "--qk-pos-emb-head-dim 32 --v-head-dim 64 --kv-channels 64 --qk-layernorm "
    "--moe-shared-expert-intermediate-size 256 --num-virtual-stages-per-pipeline-rank 2"
).split() + ["--moe-layer-freq", "([0]*2+[1]*2)"]
# DeepSeek-V3's layer and parallel layout (MLA, q/kv LoRA, 256 experts top-8 in 8 groups, a
# shared expert, dense layers first; EP 64, PP 16 interleaved) at a width and depth one GPU runs
# in a minute: hidden 1024, 8 layers, sequence 1024.
DEEPSEEK_V3_REDUCED = (
    "--num-layers 8 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16 "
    "--multi-latent-attention --q-lora-rank 384 --kv-lora-rank 128 --qk-head-dim 64 "
    "--qk-pos-emb-head-dim 32 --v-head-dim 64 --kv-channels 64 "
    "--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 256 "
    "--moe-shared-expert-intermediate-size 256 --moe-router-score-function sigmoid "
    "--moe-router-num-groups 8 --moe-router-group-topk 4 --vocab-size 4096 "
    "--seq-length 1024 --max-position-embeddings 1024 --deterministic-mode "
    "--expert-model-parallel-size 64 --pipeline-model-parallel-size 4 "
    "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 256 "
    "--use-distributed-optimizer --fake-process-group --train-iters 4"
).split() + ["--moe-layer-freq", "([0]*1+[1]*7)"]


@dataclass(frozen=True)
class GoldenLayout:
    name: str
    flags: tuple[str, ...]
    world_size: int
    rank: int
    about: str

    def env(self) -> dict[str, str]:
        return {"WORLD_SIZE": str(self.world_size), "RANK": str(self.rank)}


LAYOUTS = {layout.name: layout for layout in (
    GoldenLayout("pp2_ep8_first_stage", tuple(SMALL), 16, 0,
                 "PP 2 x EP 8, stage 0 of 1F1B (no loss), 4 microbatches"),
    GoldenLayout("pp2_ep8_last_stage_interleaved_mla", (*SMALL, *MLA), 16, 8,
                 "PP 2 x EP 8, last stage of interleaved 1F1B, MLA, dense layers first"),
    GoldenLayout("deepseek_v3_reduced_stage1", tuple(DEEPSEEK_V3_REDUCED), 256, 64,
                 "DeepSeek-V3's layer at hidden 1024, 8 layers; PP 4 (VP 2) x EP 64, stage 1"),
)}


def run(layout: GoldenLayout, workdir: Path, paged: bool = True, timeout: float = 480.0) -> dict:
    """One run of ``layout``: its losses, gradient checksums and per-iteration peaks."""
    import torch

    loss_log = workdir / f"{layout.name}_{'paged' if paged else 'unpaged'}"
    for stale in workdir.glob(f"{loss_log.name}.rank*"):
        stale.unlink()
    env = {**os.environ, **layout.env(), "PAGED": "1" if paged else "0", "PYTHON": sys.executable,
           "MEGATRON_PAGING_BENCH_LOSS_LOG": str(loss_log),
           "MEGATRON_PAGING_BENCH_NO_AUTOTUNE": "1"}
    result = subprocess.run(["bash", str(ROOT / "examples" / "run_pretrain_1gpu.sh"),
                             *layout.flags], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{layout.name}: the run failed (exit {result.returncode}):\n"
                           + log[-3000:])
    losses, grads = read_loss_log(loss_log)
    if not grads:
        raise RuntimeError(f"{layout.name}: the run logged no gradient checksum (no training "
                           "step ran):\n" + log[-3000:])
    report = read_report(log)
    return {
        "layout": layout.name, "about": layout.about, "flags": list(layout.flags),
        "env": layout.env(), "losses": losses, "grad_checksums": grads,
        "step_peak_mib": {i: float(p) for i, p, _ in STEP_MEMORY.findall(log)},
        "fb_peak_mib": {i: float(p) for i, _, p in STEP_MEMORY.findall(log)},
        "overflow_actions": report.get("overflow_actions"),
        "discarded_steps": discarded_steps(log),
        "gpu": torch.cuda.get_device_name(),
    }


def discarded_steps(log: str) -> dict[str, list[int]]:
    """The steps the run discarded, by cause: over the static dispatch budget, or a pool that
    fell short (what changes when a rerun's code path changes)."""
    return {cause: sorted({int(step) for step in pattern.findall(log)})
            for cause, pattern in DISCARDED.items()}


def compare(golden: dict, fresh: dict, tolerance: float = PEAK_TOLERANCE) -> list[str]:
    """What differs (empty: the fresh run matches): losses and gradient checksums exactly,
    peaks within ``tolerance`` of the golden value, iteration by iteration."""
    problems = []
    for field in ("losses", "grad_checksums"):
        if fresh[field] != golden[field]:
            pairs = zip(golden[field], fresh[field], strict=False)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b),
                         min(len(golden[field]), len(fresh[field])))
            problems.append(f"{field}: {len(fresh[field])} values, golden "
                            f"{len(golden[field])}; first difference at index {first}"
                            + _values_at(golden[field], fresh[field], first))
    for field in ("step_peak_mib", "fb_peak_mib"):
        if set(fresh[field]) != set(golden[field]):
            problems.append(f"{field}: iterations {sorted(fresh[field])}, golden "
                            f"{sorted(golden[field])}")
            continue
        for iteration, want in golden[field].items():
            got = fresh[field][iteration]
            if abs(got - want) > tolerance * want:
                problems.append(f"{field} iteration {iteration}: {got:.1f} MiB, golden "
                                f"{want:.1f} (more than {tolerance:.0%} apart)")
    return problems


def _values_at(golden: list[str], fresh: list[str], index: int) -> str:
    """Both values at the first difference and how far apart they are: a gap in the last bits
    (summation order, a dropped row) reads differently from a broken run."""
    if index >= min(len(golden), len(fresh)):
        return ""
    want, got = float.fromhex(golden[index]), float.fromhex(fresh[index])
    gap = abs(got - want) / abs(want) if want else float("inf")
    return f" ({fresh[index]}, golden {golden[index]}: relative gap {gap:.1e})"


def gpu_slug(gpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")


def golden_path(name: str, gpu: str) -> Path:
    return GOLDEN_DIR / f"{name}.{gpu_slug(gpu)}.json"


def check(name: str, workdir: Path) -> list[str]:
    """A fresh run of layout ``name`` against its golden file for this GPU."""
    import torch

    path = golden_path(name, torch.cuda.get_device_name())
    if not path.exists():
        raise RuntimeError(f"{name}: no golden values for this GPU ({path.name}): "
                           f"python tests/golden_values.py update {name}")
    return compare(json.loads(path.read_text()), run(LAYOUTS[name], workdir))


def update(name: str, workdir: Path) -> Path:
    """New golden values from a paged run, written only if an unpaged run of the same layout
    gives the same losses and gradient checksums bit for bit."""
    fresh = run(LAYOUTS[name], workdir)
    control = run(LAYOUTS[name], workdir, paged=False)
    for field in ("losses", "grad_checksums"):
        if fresh[field] != control[field]:
            raise RuntimeError(f"{name}: paged and unpaged {field} differ; golden values are "
                               "written only from a run that pages bitwise")
    fresh["unpaged_step_peak_mib"] = control["step_peak_mib"]
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    fresh.update(date=datetime.date.today().isoformat(), commit=commit or "unknown")
    path = golden_path(name, fresh["gpu"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fresh, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Golden values of emulated ranks: check a "
                                     "fresh run against them, or update them (needs a GPU).")
    parser.add_argument("action", choices=("check", "update"))
    parser.add_argument("layouts", nargs="*", metavar="LAYOUT",
                        help=f"default: all ({', '.join(LAYOUTS)})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown LAYOUT {unknown[0]!r} (choose from {', '.join(LAYOUTS)})")
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    names = args.layouts or list(LAYOUTS)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"{args.action} {name} ...", flush=True)
            if args.action == "update":
                path = update(name, Path(tmp))
                steps = json.loads(path.read_text())["discarded_steps"]
                print(f"  wrote {path} (discarded steps: {steps})", flush=True)
                continue
            problems = check(name, Path(tmp))
            failed += bool(problems)
            print("  matches its golden values" if not problems
                  else "  MISMATCH\n" + "\n".join(f"    {p}" for p in problems), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
