"""Is a change free of kernel effects? Hashes of every module's NVRTC cubin and of each kernel's SASS
(the cubin's ``.text.<kernel>`` sections), compiled here without a GPU, for comparing two trees.

    git archive REV cupy_flash kernels_cu | tar -x -C /tmp/base
    python -m bench.cubin_identity --tree /tmp/base /tmp/before.json [family ...]
    python -m bench.cubin_identity /tmp/after.json [family ...]           # the working tree
    python -m bench.cubin_identity --compare /tmp/before.json /tmp/after.json

Every module takes ~8 minutes on two cores; the two Hopper families ~30 s. A module whose cubin
differs but whose kernels' SASS does not changed something else (a symbol, an unused global); one
whose SASS differs needs the GPU guard (property suite, sanitizers, ``bench.ab_interleaved``).
``--compare`` also says where each entry's PTX is the same up to register names (both files made
with this version): the same program, whose SASS ptxas may still allocate differently.
Decision record: docs/decisions.md, "structure changes proved by the cubins".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import re
import struct
import sys


def text_sections(cubin: bytes) -> dict:
    """{".text.<mangled kernel>": sha1 of its SASS bytes} of an ELF cubin."""
    section_offset = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names = sections[names_index][4]
    hashes = {}
    for name_offset, _, _, _, offset, size, *_ in sections:
        name = cubin[names + name_offset:cubin.index(0, names + name_offset)].decode()
        if name.startswith(".text."):
            hashes[name] = hashlib.sha1(cubin[offset:offset + size]).hexdigest()
    return hashes


_PTX_REGISTER = re.compile(r"%(?:rd|rs|fd|hh|r|f|p|h)\d+")
_PTX_LABEL = re.compile(r"\$L__BB\d+_\d+")


def ptx_entries(ptx: str) -> dict:
    """{entry name: sha1 of its PTX with virtual registers, labels and register declarations
    renamed away} of a module's PTX. Equal hashes: the same instructions in the same order, the
    same program; its SASS can still differ, ptxas's allocation depending on the numbering."""
    hashes = {}
    for chunk in re.split(r"\n(?=\.(?:visible|weak) \.entry |\.entry )", ptx)[1:]:
        name = re.match(r"\.(?:visible \.|weak \.)?entry (\w+)", chunk).group(1)
        body = "\n".join(line for line in chunk.split("\n") if not line.lstrip().startswith(".reg "))
        body = _PTX_LABEL.sub("L", _PTX_REGISTER.sub("%", body))
        hashes[name] = hashlib.sha1(body.encode()).hexdigest()
    return hashes


def _module(case):
    from cupy_flash import _compile

    spec, arch = case
    cubin, _, _, ptx = _compile._nvrtc_compile(spec, _compile.compile_options(arch, report=False))
    return f"{spec.describe()} features={spec.features} {arch}", {
        "cubin": hashlib.sha1(cubin).hexdigest(), "sass": text_sections(cubin), "ptx": ptx_entries(ptx)}


def hash_tree(families) -> dict:
    from cupy_flash import _compile

    try:   # the families package (older trees: _compile's list)
        from cupy_flash.families import all_module_specs
    except ImportError:
        all_module_specs = _compile.all_module_specs
    cases = [(spec, arch) for spec in all_module_specs() for arch in _compile.ALL_ARCHS
             if arch in spec.archs and (not families or spec.family in families)]
    # spawned workers import the parent's sys.path, so --tree's copy in them too
    with concurrent.futures.ProcessPoolExecutor(mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(pool.map(_module, cases))


def compare(before: dict, after: dict) -> int:
    common = sorted(set(before) & set(after))
    cubin_same = [m for m in common if before[m]["cubin"] == after[m]["cubin"]]
    sass_same = [m for m in common if before[m]["sass"] == after[m]["sass"]]
    print(f"{len(common)} modules in both ({len(set(before) ^ set(after))} in one only): "
          f"{len(cubin_same)} cubins identical, {len(sass_same)} with identical SASS")
    with_ptx = [m for m in common if "ptx" in before[m] and "ptx" in after[m]]
    if with_ptx:
        ptx_same = [m for m in with_ptx if before[m]["ptx"] == after[m]["ptx"]]
        print(f"{len(ptx_same)} of {len(with_ptx)} with the same PTX up to register names")
    for module in common:
        if before[module]["sass"] != after[module]["sass"]:
            ptx = before[module].get("ptx")
            same_ptx = ptx is not None and ptx == after[module].get("ptx")
            print(f"  SASS differs: {module}{' (PTX the same up to register names)' if same_ptx else ''}")
    return 0 if len(sass_same) == len(common) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cubin_identity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="a checkout whose cupy_flash and kernels_cu to compile (default: this one)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("output", nargs="?")
    parser.add_argument("families", nargs="*")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        return compare(before, after)
    if not args.output:
        parser.error("an output file, or --compare BEFORE AFTER")
    if args.tree:
        sys.path.insert(0, args.tree)
    import cupy_flash

    print(f"compiling {cupy_flash.__file__}'s modules")
    hashes = hash_tree(set(args.families))
    with open(args.output, "w") as out:
        json.dump(hashes, out, indent=0, sort_keys=True)
    print(f"{len(hashes)} modules, {sum(len(h['sass']) for h in hashes.values())} kernels -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
