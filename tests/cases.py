"""Parametrization tables shared by several test modules (one definition, so they stay in step)."""

from __future__ import annotations

import torch

# (schedule, options) for megatron_paging.mcore.op_order: every pipeline shape the scheduler
# and the schedule vocabulary are checked on.
SCHEDULE_CASES = [
    ("1f1b", dict(pp=1, rank=0, microbatches=3)),
    ("1f1b", dict(pp=4, rank=0, microbatches=6)),
    ("1f1b", dict(pp=4, rank=2, microbatches=4, delay_wgrad=True)),
    ("interleaved", dict(pp=2, vpp=2, rank=0, microbatches=4)),
    ("interleaved", dict(pp=2, vpp=3, rank=1, microbatches=6)),
    ("interleaved", dict(pp=4, vpp=2, rank=1, microbatches=9, group_size=5)),
    ("interleaved", dict(pp=2, vpp=2, rank=1, microbatches=4, combined_1f1b=True)),
    ("interleaved", dict(pp=2, vpp=2, rank=0, microbatches=6, delay_wgrad=True)),
    ("dualpipev", dict(pp=2, rank=0, microbatches=4)),
    ("dualpipev", dict(pp=2, rank=1, microbatches=5)),
    ("dualpipev", dict(pp=3, rank=1, microbatches=6)),
]

# Optimizers whose skipped step must leave parameters and state untouched.
OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}
