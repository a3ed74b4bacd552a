"""A CPU stream backend that pretends to capture a CUDA graph (shared by the test modules)."""

from __future__ import annotations

from megatron_paging.runtime.streams import CpuStreamBackend


class CapturingBackend(CpuStreamBackend):
    """Pretends the calls run inside a CUDA-graph capture while ``capture`` is set (default:
    always), where events cannot be queried: ``done`` then fails the test."""

    def __init__(self, capture: bool = True):
        super().__init__()
        self.capture = capture

    def capturing(self):
        return self.capture

    def done(self, event):
        if self.capture:
            raise AssertionError("event queried during capture")
        return True
