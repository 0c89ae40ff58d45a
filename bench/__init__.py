"""Benchmarks and device checks for cupy_flash, each run from the repository's root as
``python -m bench.<name>`` (the user-facing benchmark is ``python -m cupy_flash bench``)."""


def help_first(name: str, doc: str) -> None:
    """``python -m bench.<name> --help``: print the tool's docstring and exit, before its imports
    need a GPU, PyTorch or JAX, so the help works on any machine."""
    import sys

    if {"-h", "--help"} & set(sys.argv[1:]):
        print(f"usage: python -m bench.{name} [arguments]   (run from the repository's root)\n\n{doc.strip()}")
        raise SystemExit(0)


def peer_or_exit(name: str, module: str):
    """The optional peer ``module`` (torch, jax) imported, or one line and exit status 1 without it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise SystemExit(f"python -m bench.{name} needs {module} ({error})") from None
