"""The demo's verdict: the ``parity:`` line and the exit code (the contract in
``megatron-paging demo --help``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_paging.demo.layout import Layout
from megatron_paging.demo.training import RunResult, StepOutcome

SKIPPED = ("skipped", "grown")  # paged actions that dropped the step's update


@dataclass(frozen=True)
class Verdict:
    line: str
    exit_code: int
    problems: tuple[str, ...]


def compare(step: int, control: StepOutcome, paged: StepOutcome) -> list[str]:
    """Every difference between the runs at one step, one short phrase each."""
    problems = []
    if (control.loss is None) != (paged.loss is None) or (
        control.loss is not None and not torch.equal(control.loss, paged.loss)
    ):
        problems.append(f"step {step}: loss {control.loss} vs {paged.loss}")
    for what, c, p in (("gradient", control.grads, paged.grads),
                       ("sent input gradient", control.sent_grads, paged.sent_grads)):
        differ = [str(k) for k in c if k not in p or not torch.equal(c[k], p[k])]
        differ += [str(k) for k in p if k not in c]
        if differ:
            shown = ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else "")
            problems.append(f"step {step}: {len(differ)} {what}(s) differ ({shown})")
    return problems


@dataclass
class DemoResult:
    layout: Layout
    device: torch.device
    backend: str
    policy: str
    control: RunResult
    paged: RunResult

    def verdict(self) -> Verdict:
        """Bitwise parity of every step up to the first skipped one; whole page rings after
        every step that did not overflow; skipped steps changed no parameter or state."""
        problems = []
        skipped = [s for s, p in enumerate(self.paged.steps, 1) if p.action in SKIPPED]
        for step, p in enumerate(self.paged.steps, 1):
            if not p.overflow and p.pages_left:
                problems.append(f"step {step}: {p.pages_left} page(s) never returned to a ring")
            if step in skipped and not p.state_unchanged:
                problems.append(f"step {step}: the skipped step changed parameters or state")
        last_compared = skipped[0] - 1 if skipped else len(self.paged.steps)
        pairs = zip(self.control.steps, self.paged.steps[:last_compared], strict=False)
        for step, (c, p) in enumerate(pairs, 1):
            problems += compare(step, c, p)
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            line = f"parity: MISMATCH {'; '.join(problems[:3])}{more}"
            return Verdict(line, 1, tuple(problems))
        if not skipped:
            return Verdict("parity: bitwise", 0, ())
        line = (
            f"parity: n/a (policy {self.policy} skipped {len(skipped)} step(s); steps before "
            f"step {skipped[0]} bitwise, skipped steps left parameters and optimizer state "
            "unchanged)"
        )
        return Verdict(line, 0, ())


__all__ = ["DemoResult", "Verdict", "compare"]
