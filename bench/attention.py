"""The attention benchmark's helpers for the development tools here (timing, input sets, FLOPs, the
peers): they live in the package, cupy_flash/benchmark.py, whose main is ``python -m cupy_flash
bench`` (``python -m bench`` in this directory's parent)."""

from cupy_flash.benchmark import (  # noqa: F401 - re-exported for bench/*.py
    DTYPES,
    flops,
    main,
    make_sets,
    ours,
    time_calls,
    time_queued,
    to_torch,
    torch_peer,
    torch_sets,
)
