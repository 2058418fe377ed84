"""Meta-tests (datasette's test_docs habit): every hook is documented and tested.

A new hookspec fails here until it has a docstring stating its arguments, return value
and firstresult behaviour, appears in some test module under tests/, has a HookRelay
attribute, and is described in docs/PLUGINS.md.
"""
from __future__ import annotations

import types
from pathlib import Path

import pytest

from colibri_core import hookspecs
from colibri_core.plugins import HOOK_NAMES, HookRelay

TESTS = Path(__file__).resolve().parent
DOCS = TESTS.parent / "docs" / "PLUGINS.md"
SPEC_ATTR = hookspecs.PROJECT_NAME + "_spec"


def hookspec_functions(module) -> dict:
    """name -> function for every function of ``module`` marked as a colibri hookspec."""
    return {
        name: fn
        for name, fn in vars(module).items()
        if isinstance(fn, types.FunctionType) and hasattr(fn, SPEC_ATTR)
    }


def docstring_problems(name: str, fn) -> list[str]:
    doc = (fn.__doc__ or "").strip()
    if not doc:
        return [f"{name}: no docstring"]
    problems = []
    for section in ("Arguments:", "Returns:"):
        if section not in doc and not (section == "Arguments:" and not _params(fn)):
            problems.append(f"{name}: docstring has no {section!r} section")
    for param in _params(fn):
        if f"{param}:" not in doc:
            problems.append(f"{name}: argument {param!r} is not described")
    firstresult = getattr(fn, SPEC_ATTR).get("firstresult", False)
    wanted = "First result wins" if firstresult else "every implementation is called"
    if wanted not in doc:
        problems.append(f"{name}: docstring must say {wanted!r}")
    return problems


def _params(fn) -> list[str]:
    return list(fn.__code__.co_varnames[: fn.__code__.co_argcount])


def sources_of_tests() -> str:
    """Text of every test module except this one."""
    return "\n".join(p.read_text() for p in sorted(TESTS.rglob("test_*.py")) if p.name != Path(__file__).name)


SPECS = hookspec_functions(hookspecs)


def test_hook_names_match_specs():
    assert SPECS and set(SPECS) == set(HOOK_NAMES)
    assert all(name.startswith("colibri_") for name in SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hookspec_is_documented(name):
    assert docstring_problems(name, SPECS[name]) == []


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hookspec_is_named_in_a_test(name):
    assert name in sources_of_tests(), f"hook {name} does not appear in any test file under tests/"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hookspec_has_relay_attribute_and_docs(name):
    assert name[len("colibri_") :] in HookRelay.__slots__
    assert f"`{name}`" in DOCS.read_text(), f"hook {name} is not described in docs/PLUGINS.md"


def test_checks_catch_an_undocumented_untested_hook():
    """The checks above really fail for a bad spec (not just pass vacuously)."""
    fake = types.ModuleType("fake_specs")
    exec(
        "from colibri_core.hookspecs import hookspec\n"
        "@hookspec\ndef colibri_brand_new_hook(x): pass\n"
        "@hookspec(firstresult=True)\ndef colibri_half_documented(a, b):\n"
        "    '''Arguments:\\n a: thing\\n Returns: int. every implementation is called'''\n",
        fake.__dict__,
    )
    specs = hookspec_functions(fake)
    assert docstring_problems("colibri_brand_new_hook", specs["colibri_brand_new_hook"]) == [
        "colibri_brand_new_hook: no docstring"
    ]
    assert docstring_problems("colibri_half_documented", specs["colibri_half_documented"]) == [
        "colibri_half_documented: argument 'b' is not described",
        "colibri_half_documented: docstring must say 'First result wins'",
    ]
    assert "colibri_brand_new_hook" not in sources_of_tests()
