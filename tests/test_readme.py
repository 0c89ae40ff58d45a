"""CPU: the API reference's signatures of the public functions (docs/api.md, which the README
links) are their real ones (inspect.signature): every parameter, its kind and its default."""

import ast
import inspect
import pathlib
import re

import pytest

import cupy_flash

README = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()   # the API reference
PUBLIC = [name for name in cupy_flash.__all__ if callable(getattr(cupy_flash, name))]


def readme_signatures() -> dict:
    """{function name: parameter list text} of every `name(...)` code span in docs/api.md that spells
    out its parameters (spans written with "..." are examples, not signatures)."""
    found = {}
    prose = re.sub(r"```.*?```", "", README, flags=re.S)   # code blocks hold calls, not signatures
    for span in re.findall(r"`([^`]+)`", prose):
        match = re.match(r"(\w+)\((.*)\)(?:\s*->.*)?$", span.strip(), re.S)
        if match and match.group(1) in PUBLIC and "..." not in match.group(2) and "*" in match.group(2):
            found[match.group(1)] = " ".join(match.group(2).split())
    return found


def parameters_of(text: str) -> list:
    """[(name, kind, default)] of a parameter list written as Python."""
    arguments = ast.parse(f"def f({text}): pass").body[0].args
    result = [(a.arg, "positional", None) for a in arguments.posonlyargs + arguments.args]
    result += [(a.arg, "keyword", None if d is None else ast.literal_eval(d))
               for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    if arguments.kwarg is not None:
        result.append(("**", "var_keyword", None))
    return result


def signature_of(function) -> list:
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional", inspect.Parameter.KEYWORD_ONLY: "keyword",
             inspect.Parameter.VAR_KEYWORD: "var_keyword"}
    result = []
    for p in inspect.signature(function).parameters.values():
        default = None if p.default is inspect.Parameter.empty else p.default
        result.append(("**" if p.kind is inspect.Parameter.VAR_KEYWORD else p.name, kinds[p.kind], default))
    return result


def test_every_public_function_has_its_signature_in_the_readme():
    assert sorted(readme_signatures()) == sorted(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_readme_signature_matches_the_function(name):
    written = readme_signatures().get(name)
    if written is None:
        pytest.fail(f"docs/api.md has no full signature of {name}")
    assert parameters_of(written) == signature_of(getattr(cupy_flash, name)), (name, written)


def test_every_public_call_takes_stream():
    for name in PUBLIC:
        assert "stream" in inspect.signature(getattr(cupy_flash, name)).parameters, name
