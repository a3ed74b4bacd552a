"""TEMPORARY variant sweep (deleted before commit)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as b  # noqa: E402

ORIG = os.environ.get("SWEEP_ORIG") == "1"
VARIANTS = ["orig"] if ORIG else ["4,0,4,1", "4,0,4,0", "4,0,3,1", "4,0,3,0", "4,1,3,1", "4,1,3,0", "4,1,4,1",
            "4,1,4,0", "8,0,2,1", "8,0,2,0", "8,1,2,1", "8,1,2,0"]
timer = b.Timer(20)
for idx in (0, 3, 4, 5):
    case = b.Case(b.REGIMES[idx], None)
    out, _ = case.copy_fns()
    line = [f"{b.REGIMES[idx].name[:22]:<22} copy={b.gbps(case.moved, timer(out)):6.0f}"]
    for v in VARIANTS:
        if not ORIG:
            os.environ["MEGATRON_PAGING_EXPERIMENT"] = v
        b.verify(case)
        st = b.gbps(case.moved, timer(case.stash, case.reset))
        rl = b.gbps(case.moved, timer(case.reload, case.reset_and_stash))
        line.append(f"{v}:{st:.0f}/{rl:.0f}")
    if b.REGIMES[idx].host_spill and not ORIG:
        os.environ["MEGATRON_PAGING_EXPERIMENT"] = "4,0,4,1"
        for m in (64, 132, 264):
            st = b.gbps(case.moved, timer(lambda m=m: case.stash(m), case.reset))
            rl = b.gbps(case.moved, timer(lambda m=m: case.reload(m), case.reset_and_stash))
            line.append(f"ctas{m}:{st:.0f}/{rl:.0f}")
    print(" ".join(line), flush=True)
    del case
    torch.cuda.empty_cache()
os.environ.pop("MEGATRON_PAGING_EXPERIMENT", None)
