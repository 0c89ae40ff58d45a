"""The JAX ring on virtual CPU devices (tests/jax_ring_cpu.py, in a process of its own): its
schedule, merges, sink, shifts and gradients against the float64 reference of the unsplit
sequence, the kernels' calls replaced by dense float32 attention in JAX. The kernels themselves
run in tests/test_adapters_gpu.py (jax_ring) on real GPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parents[1]


def test_jax_ring_on_virtual_cpu_devices_matches_the_reference():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "jax_ring_cpu.py")], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 5 and any(r["sink"] for r in results), done.stdout
    for result in results:
        # float32 blocks against float64: a few units of float32's rounding, relative to max(1, |x|)
        worst = max(result["errors"].values())
        assert worst < 1e-5, result
        assert ("dsink" in result["errors"]) == result["sink"], result


def test_jax_ring_refuses_a_sink_of_the_wrong_shape():
    """ring_attention's sink is a float logit per query head; anything else is a ValueError naming
    it, raised when traced, before the ring is built."""
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import ring_attention

    q = jnp.zeros((1, 8, 4, 32), jnp.float32)
    for sink in (jnp.zeros(3, jnp.float32), jnp.zeros((4, 1), jnp.float32), jnp.zeros(4, jnp.int32), [0.0] * 4):
        with pytest.raises(ValueError, match="sink must be a float array of shape \\(4,\\)"):
            ring_attention(q, q[:, :, :2], q[:, :, :2], "ring", sink=sink)
