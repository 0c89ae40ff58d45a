"""A GPU test file in parallel shards, for a fresh device machine: most of a cold run is NVRTC
compiling the modules the property tests draw (one CPU core each), so N pytest processes share
the GPU and the cores. Tests are dealt to the shards by expected time, longest first, each to the
shard with the least so far (SECONDS: measured times of the long ones, the rest DEFAULT_SECONDS),
so one long test does not share a shard with a full share of the others. Logs per shard under
--logs (pytest -v, unbuffered, with per-test durations: a shard that times out shows the test it
was in); a summary (passed / failed / skipped per shard, the FAILED lines) is printed last; exit
status 1 on any failure or timeout.

    python bench/gpu_suite.py tests/test_attention_gpu.py tests/test_decode.py --shards 8 --timeout 420 --logs $OUT/suite
    python bench/gpu_suite.py tests/test_attention_gpu.py -k "backward and hopper" --shards 8   # the selected ones dealt
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# Cold-machine seconds of the tests that take far more than the others (H100, 2026-11-23: the
# Hopper packed-batch property test compiles a module per drawn feature set; dealt every 8th id it
# shared a shard with 8 others and that shard ran past a 220 s limit while the rest took 51-132 s).
SECONDS = {"test_packed_batches_match_reference[hopper]": 190.0}
DEFAULT_SECONDS = 12.0


def expected_seconds(test_id: str) -> float:
    return next((seconds for name, seconds in SECONDS.items() if test_id.endswith("::" + name)), DEFAULT_SECONDS)


def deal(ids: list[str], shards: int) -> list[list[str]]:
    """The ids in `shards` groups: longest expected first, each to the group with the least time."""
    groups, totals = [[] for _ in range(shards)], [0.0] * shards
    for test_id in sorted(ids, key=expected_seconds, reverse=True):
        n = totals.index(min(totals))
        groups[n].append(test_id)
        totals[n] += expected_seconds(test_id)
    return [group for group in groups if group]


def collect(paths: list[str], keyword: str | None = None) -> list[str]:
    """The test ids pytest collects from ``paths`` (files, directories or ids), selected by ``-k
    keyword`` here, so the shards share the selected tests (a -k given to each shard instead left
    every selected test where the unselected ones had dealt it: one shard ran them all)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths]
    if keyword:
        command += ["-k", keyword]
    listing = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in listing.splitlines() if "::" in line]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_suite", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="test files, directories or ids")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds for all shards together")
    parser.add_argument("--logs", default="/tmp/gpu_suite")
    parser.add_argument("-k", default=None, help="pytest -k expression, applied when collecting")
    args = parser.parse_args()
    ids = collect(args.paths, args.k)
    if not ids:
        print(f"no tests collected from {' '.join(args.paths)}{f' with -k {args.k!r}' if args.k else ''}")
        return 1
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    shards = []
    for n, group in enumerate(deal(ids, args.shards)):
        command = [sys.executable, "-m", "pytest", "-v", "--durations=0", "-p", "no:cacheprovider", *group]
        log = open(logs / f"shard{n}.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        shards.append((n, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    timed_out = []
    for n, process, log in shards:
        try:
            process.wait(timeout=max(1.0, args.timeout - (time.time() - started)))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            timed_out.append(n)
        log.close()
    totals, failed_lines = {}, []
    for n, process, _ in shards:
        text = (logs / f"shard{n}.log").read_text(errors="replace")
        tail = text.strip().splitlines()[-1] if text.strip() else ""
        if n in timed_out:   # pytest -v names each test as it starts: the last one named was running
            running = [line.split()[0] for line in text.splitlines() if "::" in line and not line.startswith(" ")]
            tail = f"in {running[-1]}" if running else "before its first test"
        for count, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", tail):
            totals[word] = totals.get(word, 0) + int(count)
        failed_lines += [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
        print(f"shard {n}: rc={process.returncode}{' (timed out)' if n in timed_out else ''}  {tail[:160]}")
    print(f"{len(ids)} tests in {len(shards)} shards, {time.time() - started:.0f} s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(totals.items())))
    for line in failed_lines[:30]:
        print(line[:300])
    return 1 if timed_out or failed_lines or any(p.returncode not in (0, 5) for _, p, _ in shards) else 0


if __name__ == "__main__":
    sys.exit(main())
