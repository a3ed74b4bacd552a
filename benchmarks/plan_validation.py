"""Predicted against measured memory: :func:`compare` for one measured record and a plan, the
historical H200 runs (``plan_measured.py``) replayed through the plan, and the fit of the model's
one constant (``megatron_paging.plan.CONSTANTS``).

A measured record is what the example prints per arm (examples/pretrain_gpt_moe_paged.py, or a
benchmark summary of it): ``{arm: {"steady_peak_allocated_mib": ..., "steady_fb_peak_allocated_mib":
..., "param_mib": ..., "grad_mib": ..., "optimizer_state_mib": ..., "pool_cuda_mib": ...}}``;
values may be strings, missing quantities are skipped.

``python benchmarks/plan_validation.py`` prints the historical comparison and the fit.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from arm_names import plan_arm_of
from plan_measured import FIT_ARM, FIT_SIZE, RECORDS, line_for

from megatron_paging.plan.arms import CONSTANTS, MIB, ArmSpec, Constants, arm, evaluate

QUANTITIES = (
    ("peak", "steady_peak_allocated_mib"),
    ("fb_peak", "steady_fb_peak_allocated_mib"),
    ("params", "param_mib"),
    ("grads", "grad_mib"),
    ("optimizer", "optimizer_state_mib"),
    ("pool_device", "pool_cuda_mib"),
)
# Variants the plan's arm does not model as they ran, for validation only.
VARIANT_SPECS = {spec.name: spec for spec in (
    ArmSpec("unpaged.recompute_fc1", "--paging-recompute-expert-fc1",
            "unpaged experts that keep only x", recompute_fc1=True),
)}


@dataclass(frozen=True)
class Comparison:
    arm: str
    quantity: str  # an ArmMemory field
    predicted_mib: float
    measured_mib: float

    @property
    def error_mib(self) -> float:
        return self.predicted_mib - self.measured_mib

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured; 0 when both are 0."""
        if self.measured_mib == 0:
            return 0.0 if self.predicted_mib == 0 else float("inf")
        return self.error_mib / self.measured_mib


def compare(record: dict, plan) -> list[Comparison]:
    """Predicted vs measured for every arm of ``record`` the plan has (``plan``: a Plan or a
    mapping of arm name -> ArmMemory); a variant the plan lacks is read as its plan arm
    (``mcore.x`` -> ``mcore``)."""
    arms = plan.arms if hasattr(plan, "arms") else plan
    out = []
    for name, measured in record.items():
        memory = arms.get(name) or arms.get(plan_arm_of(name))
        if memory is None:
            raise ValueError(f"measured arm {name!r} is not in the plan (arms: "
                             f"{', '.join(arms)})")
        for field, key in QUANTITIES:
            if measured.get(key) in (None, ""):
                continue
            out.append(Comparison(name, field, getattr(memory, field) / MIB,
                                  float(measured[key])))
    return out


def _spec(name: str) -> ArmSpec:
    """The arm the plan evaluates for a run of arm ``name``."""
    return VARIANT_SPECS.get(name) or arm(plan_arm_of(name))


def historical(records=RECORDS, constants: Constants = CONSTANTS):
    """``[(record, [Comparison, ...])]``: every record replayed through the plan (one Megatron
    parse per distinct launch line; the one-GPU layouts have one pipeline stage)."""
    from megatron_paging.mcore.plan_inputs import parse_megatron, plan_inputs, quiet

    inputs_of: dict[tuple, object] = {}
    out = []
    for record in records:
        line = tuple(line_for(record))
        if line not in inputs_of:
            with quiet():
                inputs_of[line] = plan_inputs(parse_megatron(list(line), world_size=1))
        inputs = inputs_of[line]
        paging = inputs.paging
        if record.pool_kept_across_steps:
            paging = dataclasses.replace(paging, persistent_pool=True)
        stage = inputs.stages[0]
        memory = evaluate(inputs.model, inputs.parallel, stage.chunks, stage.ops, 0,
                          _spec(record.arm), paging, constants)
        out.append((record, compare({record.arm: record.as_measured()}, {record.arm: memory})))
    return out


def fit_workspace(records=RECORDS) -> float:
    """The workspace constant: on the one-GPU example's unpaged arm (its only fit), the mean of
    the forward-backward and the optimizer-step residuals of the model without it."""
    fit = [r for r in records if r.size == FIT_SIZE and r.arm == FIT_ARM]
    rows = historical(fit, Constants(workspace_mib=0.0))[0][1]
    residual = {c.quantity: -c.error_mib for c in rows}
    return (residual["peak"] + residual["fb_peak"]) / 2


def format_comparisons(results) -> str:
    lines = [f"{'size':<13}{'arm':<27}{'commit':<9}{'quantity':<12}{'predicted':>11}"
             f"{'measured':>11}{'error':>9}{'rel':>8}"]
    for record, rows in results:
        for c in rows:
            lines.append(f"{record.size:<13}{record.arm:<27}{record.commit:<9}{c.quantity:<12}"
                         f"{c.predicted_mib:>11.1f}{c.measured_mib:>11.1f}{c.error_mib:>9.1f}"
                         f"{100 * c.relative_error:>7.2f}%")
    return "\n".join(lines)


def main() -> int:
    results = historical()
    print(format_comparisons(results))
    print(f"\nworkspace constant: frozen {CONSTANTS.workspace_mib} MiB, refit "
          f"{fit_workspace():.1f} MiB (on {FIT_SIZE}:{FIT_ARM})")
    return 0


__all__ = ["Comparison", "QUANTITIES", "VARIANT_SPECS", "compare", "fit_workspace",
           "format_comparisons", "historical"]

if __name__ == "__main__":
    sys.exit(main())
