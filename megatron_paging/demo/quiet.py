"""Import Megatron quietly: on a CPU-only machine importing Megatron-Core logs "No CUDA runtime
is found" and warns about missing Transformer Engine / apex, and importing megatron.training
(the flags' group factory) sends the root logger's INFO records to stdout. None of it concerns
the demo, whose stdout is its table and whose errors are one line on stderr."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_megatron() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
        root.handlers[:] = handlers
        root.setLevel(level)


__all__ = ["quiet_megatron"]
