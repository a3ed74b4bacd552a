"""The example's step probe: per-iteration peak memory and host time, exact per-microbatch
losses, a torch.profiler summary, an allocator trace or a kernel count of chosen iterations.

Diagnostics of ``examples/pretrain_gpt_moe_paged.py`` (kept out of the training script and out of
the ``megatron_paging`` runtime); chosen by environment variables read once at import.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from megatron.training import get_args

from megatron_paging.tools.kernel_timeline import timeline_record
from megatron_paging.tools.memory_trace import format_breakdown, peak_breakdown

# Verification runs: append every microbatch loss, exactly (float.hex), to this file (+ rank).
LOSS_LOG_ENV = "MEGATRON_PAGING_BENCH_LOSS_LOG"
# Diagnostics: profile this training iteration (1-based, as Megatron logs it) with torch.profiler
# and print its top kernels and host ops.
PROFILE_ENV = "MEGATRON_PAGING_BENCH_PROFILE_ITER"
# Diagnostics: record the allocator's history during this iteration and print what is alive at
# its peak, grouped by the code that allocated it (megatron_paging.tools.memory_trace).
MEMORY_ENV = "MEGATRON_PAGING_BENCH_MEMORY_ITER"
# Verification: count the CUDA kernels of these iterations (comma-separated, e.g. "6,7"), so a
# run can show that every replay of a captured CUDA graph launches the same work.
KERNEL_COUNT_ENV = "MEGATRON_PAGING_BENCH_KERNEL_COUNT_ITERS"
# Verification: drop the update of these iterations (comma-separated): the torch optimizers'
# step is not called, as 'skip' and 'grow' drop an overflowing step's update, so an unpaged
# control can match a paged run whose steps they dropped.
DROP_ENV = "MEGATRON_PAGING_BENCH_DROP_ITERS"
# Diagnostics: write the profiled iteration's kernel timeline (every kernel's stream, start and
# duration) to this JSON file (+ rank); read it with
# python -m megatron_paging.tools.kernel_timeline.
PROFILE_JSON_ENV = "MEGATRON_PAGING_BENCH_PROFILE_JSON"
# Verification ("1"): Inductor does not autotune the pointwise kernels of what Megatron-Core
# compiles. Its benchmark allocates a buffer the size of the L2 cache (50 MiB on H100) whenever a
# kernel's best configuration is not yet in Inductor's on-disk cache, so a step's peak would
# depend on that cache's state; golden values (tests/golden_values.py) compare peaks.
NO_AUTOTUNE_ENV = "MEGATRON_PAGING_BENCH_NO_AUTOTUNE"


def iterations_from_env(name: str) -> tuple[int, ...]:
    """Comma-separated positive iterations from ``name`` (empty: none); a bad value stops the
    run at start-up with one line naming the variable."""
    value = os.environ.get(name, "")
    try:
        iterations = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        iterations = (0,)
    if any(i < 1 for i in iterations):
        raise SystemExit(f"error: {name}={value!r}: expected training iterations >= 1, e.g. 5")
    return iterations


class StepProbe:
    """Per-iteration peak memory, exact per-microbatch losses, and a torch.profiler summary of
    one chosen iteration.

    Megatron's loop has no per-iteration callback, so the probe wraps the step runner that
    ``train()`` builds (:func:`observe_training_steps`): a step's window runs from the start of
    its forward-backward to the start of the next one (its optimizer step included). That works
    with full-iteration CUDA graphs too, where no Python inside forward-backward runs on a
    replay. Every line it prints starts with ``paging-example``.
    """

    def __init__(self, profile_iteration: int | None, memory_iteration: int | None,
                 count_iterations: tuple[int, ...] = ()):
        self.iteration = None
        self.profile_iteration = profile_iteration
        self.memory_iteration = memory_iteration
        self.count_iterations = count_iterations
        self.counter = None  # torch.profiler of a kernel-count iteration
        self.runner = None  # the step runner train() built (its overflow counters are reported)
        self.training_mode = None  # the paging mode of the last training step
        self.peers = None  # EmulatedPeers under --fake-process-group (their counts are reported)
        self.grad_checksums: dict[int, float] = {}
        self.loss_lines: list[str] = []  # the open iteration's loss-log lines (see on_step_end)
        self.model = self.optimizer = None  # what the runner trains (its memory is reported)
        self.recording = False
        self.memory_base_mib = 0.0  # allocated when the recorded iteration began
        self.step_peaks: dict[int, float] = {}
        self.fb_peaks: dict[int, float] = {}  # forward-backward only: where activations peak
        # Host (main-thread CPU) ms per forward-backward and per whole step: what a graph
        # replay removes. CPU time, so a spin-wait at a CUDA sync counts, a sleep does not.
        self.host_fb_ms: dict[int, float] = {}
        self.host_step_ms: dict[int, float] = {}
        self.host_t0 = 0.0
        # The caching allocator's retries (free every cached block, then cudaMalloc again) from
        # the third step on: near a memory cap they, not the model, can set the step time.
        self.retries_at_step3: int | None = None
        self.profiler = None
        self.profile_t0 = 0.0

    def on_step_start(self) -> None:
        iteration = get_args().curr_iteration + 1  # Megatron logs iterations from 1
        if iteration == self.iteration:
            return
        self.close_step()
        torch.cuda.reset_peak_memory_stats()
        self.iteration = iteration
        self.host_t0 = time.thread_time()
        if iteration == 3:
            self.retries_at_step3 = alloc_retries()
        if iteration == self.memory_iteration:
            self.recording = True
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            self.memory_base_mib = torch.cuda.memory_allocated() / 2**20
        if iteration in self.count_iterations:
            torch.cuda.synchronize()
            self.counter = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.counter.start()
        if iteration == self.profile_iteration:
            torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            self.profiler.start()
            self.profile_t0 = time.perf_counter()

    def on_step_end(self, losses_reduced) -> None:
        """Note the forward-backward's peak (before the optimizer step) and every microbatch
        loss of the step, exactly (float.hex), for the loss log."""
        self.fb_peaks[self.iteration] = torch.cuda.max_memory_allocated() / 2**20
        self.host_fb_ms[self.iteration] = (time.thread_time() - self.host_t0) * 1e3
        if self.recording:  # where activations peak; the step's peak may be the optimizer's
            self._print_memory_peak("memory-fb", stop=False)
        loss_log = os.environ.get(LOSS_LOG_ENV)
        emulated = self.peers is not None
        if not (loss_log or emulated):
            return
        # Host reads after the step: verification runs and emulated ranks only.
        losses = [report["lm loss"].tolist()[0] for report in losses_reduced or []]
        checksum = grad_checksum(self.model)
        self.grad_checksums[self.iteration] = checksum
        if (emulated and not all(math.isfinite(v) for v in (*losses, checksum))
                and not self._update_dropped()):
            # Megatron turns its NaN check off under a fake process group: this is that check.
            raise SystemExit(
                f"error: iteration {self.iteration}: non-finite loss or gradient on the "
                "emulated rank (--fake-process-group)"
            )
        if not loss_log:
            return
        # Written when the iteration closes: a forward-backward that Megatron's rerun state
        # machine runs again in place (same iteration) replaces these lines.
        self.loss_lines = [f"{float(loss).hex()} {int(num_tokens)}\n" for loss, num_tokens in
                           (report["lm loss"].tolist() for report in losses_reduced or [])]
        self.loss_lines.append(f"grad {checksum.hex()}\n")

    def _update_dropped(self) -> bool:
        """Whether the step runner drops this step's update (an overflowing step under 'skip' or
        'grow', whose gradients were computed from pages that were never written)."""
        monitor = getattr(self.runner, "monitor", None)
        skip = getattr(monitor, "skip", None)
        return skip is not None and bool(skip)

    def close_step(self) -> None:
        if self.iteration is None:
            return
        if self.loss_lines:
            rank = int(os.environ.get("RANK", "0"))
            with open(f"{os.environ[LOSS_LOG_ENV]}.rank{rank}", "a") as f:
                f.writelines(self.loss_lines)
            self.loss_lines = []
        peak = torch.cuda.max_memory_allocated() / 2**20
        self.step_peaks[self.iteration] = peak
        host = self.host_step_ms[self.iteration] = (time.thread_time() - self.host_t0) * 1e3
        print(
            f"paging-example step-memory iteration={self.iteration} peak_allocated_mib={peak:.1f} "
            f"fb_peak_allocated_mib={self.fb_peaks.get(self.iteration, float('nan')):.1f} "
            f"host_fb_ms={self.host_fb_ms.get(self.iteration, float('nan')):.1f} "
            f"host_step_ms={host:.1f}",
            flush=True,
        )
        if self.recording:
            self._print_memory_peak("memory", stop=True)
        if self.counter is not None:
            torch.cuda.synchronize()
            self.counter.stop()
            kernels = sum(
                e.count
                for e in self.counter.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA
            )
            print(f"paging-example kernels iteration={self.iteration} count={kernels}", flush=True)
            self.counter = None
        if self.profiler is not None:
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - self.profile_t0) * 1e3
            self.profiler.stop()
            self._print_profile(self.profiler, wall_ms)
            self.profiler = None

    def _print_memory_peak(self, label: str, stop: bool) -> None:
        """What is alive at the recorded trace's peak so far: ``memory-fb`` at the end of the
        forward-backward (the activations' peak), ``memory`` for the whole step."""
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        if stop:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        breakdown = peak_breakdown(trace)  # as max_memory_allocated counts
        held = peak_breakdown(trace, held=True)  # + freed blocks another stream still holds
        print(
            f"paging-example {label} iteration={self.iteration} "
            f"allocated_at_start_mib={self.memory_base_mib:.1f} trace_entries={len(trace)} "
            f"held_peak_above_start_mib={held.peak_bytes / 2**20:.1f}\n"
            + format_breakdown(breakdown, top=30, prefix=f"paging-example {label} "),
            flush=True,
        )

    def _print_profile(self, profiler, wall_ms: float) -> None:
        events = profiler.key_averages()
        # Device time of device events only (as torch's table totals it): a CPU op's own
        # "self device time" is the same kernels again.
        device_us = sum(
            e.self_device_time_total
            for e in events
            if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation
        )
        cpu_us = sum(e.self_cpu_time_total for e in events)
        print(
            f"paging-example profile iteration={self.iteration} wall_ms={wall_ms:.1f} "
            f"self_device_ms={device_us / 1e3:.1f} self_cpu_ms={cpu_us / 1e3:.1f}",
            flush=True,
        )
        path = os.environ.get(PROFILE_JSON_ENV)
        if path:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            with open(f"{path}.rank{rank}", "w") as f:
                json.dump(timeline_record(profiler.events(), self.iteration, wall_ms), f)
        for key in ("self_device_time_total", "self_cpu_time_total"):
            print(f"paging-example profile top by {key}:", flush=True)
            print(events.table(sort_by=key, row_limit=30, max_name_column_width=70), flush=True)

    def median_host_ms(self, first_iteration: int = 3, forward_backward: bool = False) -> float:
        source = self.host_fb_ms if forward_backward else self.host_step_ms
        times = sorted(t for i, t in source.items() if i >= first_iteration)
        return times[len(times) // 2] if times else float("nan")

    def steady_alloc_retries(self) -> int:
        return alloc_retries() - self.retries_at_step3 if self.retries_at_step3 is not None else 0

    def peak_mib(self, first_iteration: int = 1, forward_backward: bool = False) -> float:
        source = self.fb_peaks if forward_backward else self.step_peaks
        peaks = [p for i, p in source.items() if i >= first_iteration]
        return max(peaks) if peaks else 0.0


def grad_checksum(model) -> float:
    """The sum of every gradient element in float64, in parameter order: equal gradients give
    equal bits, so paged and unpaged runs compare bitwise on stages without a loss too."""
    sums = [
        grad.double().sum()
        for chunk in model or []
        for p in chunk.parameters()
        for grad in (getattr(p, "main_grad", None),)
        if isinstance(grad, torch.Tensor)
    ]
    return float(torch.stack(sums).sum()) if sums else 0.0


def alloc_retries() -> int:
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def pin_inductor_autotune(environ=os.environ) -> bool:
    """``MEGATRON_PAGING_BENCH_NO_AUTOTUNE=1``: pointwise autotuning off (True when set); a value
    other than 0 or 1 stops the run at start-up with one line naming the variable."""
    value = environ.get(NO_AUTOTUNE_ENV, "0")
    if value not in ("0", "1"):
        raise SystemExit(f"error: {NO_AUTOTUNE_ENV}={value!r}: expected 0 or 1")
    if value == "1":
        import torch._inductor.config as inductor_config

        inductor_config.triton.autotune_pointwise = False
    return value == "1"


pin_inductor_autotune()
PROBE = StepProbe(
    (iterations_from_env(PROFILE_ENV) or (None,))[0],
    (iterations_from_env(MEMORY_ENV) or (None,))[0],
    iterations_from_env(KERNEL_COUNT_ENV),
)


DROPPED_ITERATIONS = iterations_from_env(DROP_ENV)


def drop_updates(runner, probe: StepProbe, iterations: tuple[int, ...]) -> None:
    """``MEGATRON_PAGING_BENCH_DROP_ITERS``: the torch optimizers inside the runner's Megatron
    optimizer do not step in these iterations (parameters and optimizer state stay; Megatron's
    own bookkeeping runs as for a step that 'skip' dropped). Verification only."""
    optimizer = runner.optimizer
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    torch_optimizers = [getattr(inner, "optimizer", None) for inner in chained]
    if not torch_optimizers or not all(isinstance(o, torch.optim.Optimizer)
                                       for o in torch_optimizers):
        raise SystemExit(f"error: {DROP_ENV}: no torch optimizer found inside Megatron's")

    for torch_optimizer in torch_optimizers:
        step = torch_optimizer.step

        def maybe_step(*args, _step=step, **kwargs):
            if probe.iteration in iterations:
                return None
            return _step(*args, **kwargs)

        torch_optimizer.step = maybe_step


def observe_training_steps(probe: StepProbe, step_mode=None) -> None:
    """Wrap the step runner ``train()`` builds (ours or Megatron-Core's ``PagedStashRunner``,
    used whenever ``--moe-expert-rank-capacity-factor`` is set) so that ``probe`` sees the start
    and the result of every training forward-backward, outside any CUDA graph. ``step_mode()``,
    read after each training step, is kept as ``probe.training_mode``: the engine's mode at the
    end of the run may be an evaluation's (unpaged), not the training steps'."""
    training = sys.modules["megatron.training.training"]
    runner_cls = training.PagedStashRunner

    def observed_runner(config, copy_main_params, model, optimizer, *args, **kwargs):
        runner = runner_cls(config, copy_main_params, model, optimizer, *args, **kwargs)
        if optimizer is not None:  # evaluate() builds runners of its own, without one
            probe.runner, probe.model, probe.optimizer = runner, model, optimizer
            if DROPPED_ITERATIONS:
                drop_updates(runner, probe, DROPPED_ITERATIONS)

        def forward_backward(**step):
            training_step = not step["forward_only"]
            if training_step:
                probe.on_step_start()
            result = runner(**step)
            if training_step:
                probe.on_step_end(result)
                if step_mode is not None:
                    probe.training_mode = step_mode()
            return result

        return forward_backward

    training.PagedStashRunner = observed_runner
