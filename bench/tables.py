"""Compact markdown tables from a `python -m bench` JSON result: one table per mode, rows seqlen,
columns head_dim x causal, cells "ours TFLOP/s (ratio to flash / to cudnn)".

    python bench/tables.py docs/results/h100_bf16_v5_20261122.json
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports follow the help guard, which must run first
from bench import help_first

help_first("tables", __doc__)

import json
import sys


def tables(result) -> str:
    out = []
    rows = result["rows"]
    head_dims = sorted({r["head_dim"] for r in rows})
    seqlens = sorted({r["seqlen"] for r in rows})
    for dtype in sorted({r["dtype"] for r in rows}):
        for mode in result["modes"]:
            out.append(f"**{dtype} {mode}**, TFLOP/s of cupy_flash (ratio to flash / to cuDNN, same run):\n")
            columns = [(d, c) for d in head_dims for c in (False, True)]
            out.append("| seqlen | " + " | ".join(f"d={d}{' causal' if c else ''}" for d, c in columns) + " |")
            out.append("|---|" + "---|" * len(columns))
            for n in seqlens:
                cells = []
                for d, c in columns:
                    row = next((r for r in rows if (r["dtype"], r["head_dim"], r["seqlen"], r["causal"]) == (dtype, d, n, c)),
                               None)
                    if row is None:
                        cells.append("")
                        continue
                    ours = row[f"ours_{mode}"]
                    ratios = " / ".join(f"{ours / row[f'{p}_{mode}']:.2f}" if row.get(f"{p}_{mode}") else "n/a"
                                        for p in result["peers"])
                    cells.append(f"{ours:.0f} ({ratios})")
                out.append(f"| {n} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)

if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(tables(json.load(f)))
