"""Compile a module offline and count its SASS instructions with cuobjdump: are the mma (HMMA,
HGMMA), ldmatrix (LDSM), cp.async (LDGSTS) and TMA (UTMALDG) instructions there, any local memory
(LDL/STL)?

    python bench/sass_report.py forward_tc bfloat16 128 90 [features]
    python bench/sass_report.py forward_sm90 bfloat16 128 90a

The tensor-core families use the tile table of the architecture's target (sm90 for 90, sm80 for 80,
sm90a for the Hopper family); ``features`` is the FEATURE_* bitmask of the instantiations (default
0, the plain kernels).
"""

# ruff: noqa: E402 - the imports follow the help guard, which must run first

from bench import help_first

help_first("sass_report", __doc__)

import collections
import re
import subprocess
import sys
import tempfile

from cupy_flash import _compile


def main(family, dtype, tile, arch, features="0"):
    from cupy_flash import families

    arch_name = f"sm_{arch}"
    spec = next(s for s in families.all_module_specs((0, int(features)))
                if s.family == family and s.dtype == dtype and str(s.tile) == tile and s.features == int(features)
                and arch_name in s.archs and s.target in (None, "sm90a", "sm90" if int(arch.rstrip("a")) >= 90 else "sm80"))
    cubin, _, log, _ = _compile._nvrtc_compile(spec, _compile.compile_options(f"sm_{arch}"))
    print(f"cubin {len(cubin)} bytes, starts {cubin[:4]!r}; ptxas log {len(log)} chars")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        # cuobjdump 13 refused NVRTC 13's cubin ("does not contain device code"); nvdisasm reads it.
        for command in (["cuobjdump", "--dump-sass", f.name], ["nvdisasm", "-c", f.name]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode == 0 and done.stdout.strip():
                break
            print(f"{command[0]} failed ({done.returncode}): {done.stderr.strip()[:200]}")
        else:
            sys.exit(1)
        sass = done.stdout
        if "Function : " not in sass:   # nvdisasm: one ".text.<mangled>" section per kernel
            sass = sass.replace(".text.", "Function : ")
    for function in sass.split("Function : ")[1:]:
        name = function.split("\n", 1)[0].strip()
        opcode = r"(?:/\*[0-9a-f]{4}\*/|^)\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]{2,})\b"
        ops = collections.Counter(m.split(".")[0] for m in re.findall(opcode, function, re.M))
        wide = len(re.findall(r"LDG\.E\.128|LDGSTS\.E\.BYPASS\.LTC128B\.128|LDGSTS\.E\.128|STG\.E\.128", function))
        keys = ["HMMA", "LDSM", "LDGSTS", "LDS", "STS", "LDG", "STG", "MUFU", "FFMA", "BAR", "LDL", "STL"]
        print(name[:90])
        print("   " + "  ".join(f"{k}={ops.get(k, 0)}" for k in keys) + f"  128-bit global={wide}")

if __name__ == "__main__":
    main(*sys.argv[1:6])
