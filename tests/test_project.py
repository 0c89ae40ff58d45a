"""The README stays true: CI runs its commands, and its usage example runs."""

import pathlib
import re

import pytest
from helpers import HAS_GPU, requires_gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _first_bash_block():
    return re.search(r"```bash\n(.*?)```", README, re.S).group(1)


COMPILE_CHECK = "python -m pytest -m compile tests"


def test_ci_runs_the_readme_commands():
    commands = [line for line in _first_bash_block().splitlines() if line and not line.startswith("#")]
    install, test = commands
    ci = (ROOT / ".ci" / "run").read_text()
    # CI has no GPU: it runs the install part of command 1 (the example needs a GPU) and command 2.
    assert install.split(" && ")[0] in ci
    assert test in ci
    # and the compile check the README names for kernel work (the default run leaves it out)
    assert COMPILE_CHECK in ci and COMPILE_CHECK in README


def test_every_install_command_in_the_docs_names_extras_that_exist():
    """README's and docs/'s pip install ".[a,b]" lines ask for extras pyproject.toml defines, and the
    install hint of the error messages is worded the same way."""
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11

    from cupy_flash._device import install_hint

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    texts = [README] + [path.read_text() for path in (ROOT / "docs").glob("*.md")]
    asked = {extra for text in texts for group in re.findall(r'pip install "\.\[([\w,-]+)\]"', text)
             for extra in group.split(",")}
    assert {"cuda12", "test", "torch", "jax", "distributed"} <= asked and asked <= extras, (asked, extras)
    assert install_hint("cuda12,jax") in "".join(texts)   # the error messages word it as the docs do


def test_kernel_sources_ship_as_package_data():
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["cupy_flash.kernels_cu"] == "kernels_cu"
    sources = {p.name for p in (ROOT / "kernels_cu").iterdir()}
    assert {"common.cuh", "forward.cu", "preprocess.cu", "backward.cu"} <= sources


@requires_gpu
def test_readme_usage_example_runs():
    block = re.search(r"## Use\n\n```python\n(.*?)```", README, re.S).group(1)
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["dq"].shape == namespace["q"].shape
    # the decoding example after it, in the same namespace (it appends one token per sequence)
    decoding = re.findall(r"```python\n(.*?)```", README, re.S)[1]
    assert "flash_decode(" in decoding
    exec(compile(decoding, "README.md", "exec"), namespace)
    assert namespace["o"].shape == (4, 1, 64, 128) and int(namespace["lengths"].min()) == 1


@requires_gpu
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_readme_framework_examples_run(framework):
    """The README's PyTorch lines and its JAX lines (one block, a blank line between), each on the
    framework's arrays of the usage example's shape."""
    module = pytest.importorskip(framework)
    block = re.search(r"## PyTorch and JAX\n\n```python\n(.*?)```", README, re.S).group(1)
    torch_lines, jax_lines = block.split("\n\n")
    shape = (2, 512, 4, 64)
    if framework == "torch":
        q, k, v = (module.randn(shape, device="cuda", dtype=module.bfloat16) for _ in range(3))
        namespace = dict(q=q, k=k, v=v)
        exec(compile(torch_lines, "README.md", "exec"), namespace)
    else:
        q, k, v = (module.random.normal(module.random.PRNGKey(i), shape, dtype=module.numpy.bfloat16) for i in range(3))
        namespace = dict(q=q, k=k, v=v, jax=module)
        exec(compile(jax_lines, "README.md", "exec"), namespace)
    assert tuple(namespace["o"].shape) == shape


@requires_gpu
def test_quickstart_example_runs():
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max |o - reference|" in done.stdout


def _run_example(args, timeout=600):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


@requires_gpu
def test_tiny_lm_learns_and_matches_dense_attention(tmp_path):
    """The CuPy-only language model: its loss falls, and the run with dense reference attention
    (same weights, same batches) follows the same curve."""
    import json

    done = _run_example([str(ROOT / "examples" / "train_tiny_lm.py"), "--steps", "60", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stdout + done.stderr
    curves = json.loads((tmp_path / "loss_curves.json").read_text())
    flash, dense = curves["flash"], curves["dense reference"]
    assert len(flash) == len(dense) == 60
    assert sum(flash[-10:]) / 10 < 0.8 * flash[0], flash   # learning
    assert max(abs(a - b) for a, b in zip(flash, dense)) < 0.05, (flash, dense)


@requires_gpu
def test_ring_attention_example_runs_on_virtual_ranks():
    done = _run_example([str(ROOT / "examples" / "ring_attention.py"), "--tokens", "6144", "--virtual-ranks", "3"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("max |ring - one GPU|") == 4, done.stdout


@requires_gpu
def test_jax_example_runs():
    pytest.importorskip("jax")
    done = _run_example([str(ROOT / "examples" / "jax_interop.py")])
    assert done.returncode == 0, done.stdout + done.stderr
    errors = [float(line.rsplit("=", 1)[1]) for line in done.stdout.splitlines() if "max |cupy_flash" in line]
    assert len(errors) == 2 and max(errors) < 2e-2, done.stdout


@requires_gpu
@pytest.mark.parametrize("example, framework", [("jax_train_step.py", "jax"), ("torch_compile.py", "torch")])
def test_compiled_framework_examples_train_like_the_reference(example, framework):
    pytest.importorskip(framework)
    done = _run_example([str(ROOT / "examples" / example)], timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "largest relative gap" in done.stdout, done.stdout


@pytest.mark.skipif(HAS_GPU, reason="the no-GPU answer (a GPU is present)")
@pytest.mark.parametrize("command", [["examples/quickstart.py"], ["examples/train_tiny_lm.py", "--steps", "1"],
                                     ["examples/jax_interop.py"], ["examples/jax_train_step.py"],
                                     ["examples/torch_compile.py"], ["examples/ring_attention.py"], ["-m", "bench"],
                                     ["-m", "cupy_flash", "check"]])
def test_without_a_gpu_every_entry_point_says_why_in_one_line(command):
    """No traceback, no "insufficient driver": one line naming what is missing, exit status 1."""
    done = _run_example([str(ROOT / part) if part.endswith(".py") else part for part in command], timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr and "insufficient" not in done.stderr, done.stderr
    assert any(reason in lines[0] for reason in ("needs an NVIDIA GPU: ", "needs JAX", "needs PyTorch")), lines


def _shown_commands() -> list:
    """The commands the README shows that run an example or a module of ours (inline code and the
    lines of bash blocks), from ``python`` on: pip and pytest lines are the CI's own."""
    texts = [README]
    spans = [span for text in texts for span in re.findall(r"`([^`\n]+)`", text)]
    spans += [line for text in texts for block in re.findall(r"```bash\n(.*?)```", text, re.S)
              for line in block.splitlines()]
    commands = set()
    for span in spans:
        for part in span.split(" && "):
            part = part.split("#")[0].strip()
            match = re.search(r"(?:^|\s)python3? (-m [\w.]+|\S+\.py)(.*)$", part)
            if match and "|" not in part and "pytest" not in match.group(1) and "<" not in part:
                commands.add((match.group(1) + match.group(2)).strip())
    return sorted(commands)


def test_the_readme_shows_the_commands_users_run():
    shown = _shown_commands()
    for command in ("-m cupy_flash bench", "examples/quickstart.py",
                    "-m cupy_flash launch -n 4 examples/ring_attention.py --tokens 65536"):
        assert command in shown, shown


@pytest.mark.skipif(HAS_GPU, reason="the no-GPU answer (a GPU is present)")
@pytest.mark.parametrize("command", _shown_commands())
def test_every_command_the_docs_show_parses_on_a_cpu(command):
    """Each command of the README that starts an example or one of our modules takes its arguments
    as printed: on a CPU it stops at the GPU check, after parsing them (exit status 1 and
    one line; a misspelt flag would exit 2 with argparse's usage)."""
    done = _run_example([str(ROOT / part) if part.endswith(".py") else part for part in command.split()], timeout=120)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert "usage:" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def _package_imports() -> dict:
    """cupy_flash's modules -> the package modules each imports, at its top or inside a function."""
    import ast

    package = ROOT / "cupy_flash"
    modules = {path.stem for path in package.glob("*.py")}
    graph = {}
    for path in package.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [alias.name for alias in node.names]
                imported.update(name.split(".")[0] for name in names if name.split(".")[0] in modules)
        graph[path.stem] = imported - {path.stem}
    return graph


def test_the_package_has_no_import_cycle():
    """No chain of imports (a function's own included) leads a module of cupy_flash back to itself."""
    graph = _package_imports()
    assert graph["_checks"] and graph["forward"], graph   # the walk found the package's imports
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
