"""One run of the example script: a frontier arm at a model size, or a budget candidate (the
arm at one sequence length under a memory cap). ``plan``, ``budget``, ``logs`` and
``bench_step_ratio.py`` share it; it depends on ``arms`` alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from .arms import ARMS, frontier_extra


@dataclass
class Task:
    kind: str  # "arm" (frontier) or "budget"
    size: str
    arm: str
    extra: tuple[str, ...]  # flags appended to the example script
    iters: int
    seq: int | None = None
    env: dict = field(default_factory=dict)  # the arm's benchmark controls, --env, the cap
    search: dict | None = None
    cap_gib: float | None = None

    @property
    def paged(self) -> bool:
        return ARMS[self.arm].paged

    @property
    def key(self) -> str:
        if self.kind == "arm":
            return f"{self.size}:{self.arm}"
        alloc = self.env.get("PYTORCH_CUDA_ALLOC_CONF")
        return (f"budget:{self.size}:{self.arm}:{self.seq}:{self.cap_gib:g}GiB"
                + (f":{alloc}" if alloc else ""))

    @property
    def log_name(self) -> str:
        if self.kind == "arm":
            return f"frontier_{self.size}_{self.arm}"
        alloc = "_expandable" if "expandable_segments:True" in self.env.get(
            "PYTORCH_CUDA_ALLOC_CONF", "") else ""
        return f"frontier_budget_{self.size}_{self.arm}_s{self.seq}{alloc}"


def arm_task(size: str, arm: str, iters: int, env: dict | None = None) -> Task:
    """The frontier run of ``arm`` at ``size``: its flags, its benchmark controls, then ``env``
    (the call's ``--env``) on top."""
    return Task("arm", size, arm, tuple(frontier_extra(size, arm, iters)), iters,
                env={**ARMS[arm].env, **(env or {})})
