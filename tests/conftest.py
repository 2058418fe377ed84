import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small random mixed-stack model written directly in Colibri's format (no torch):
    layer 0 dense, layers 1-2 MoE (4 experts, top-2, gated shared expert)."""
    from colibri_core.model.testing import write_random_model
    d = tmp_path_factory.mktemp("tiny")
    write_random_model(d / "m", seed=0)
    return d / "m"


@pytest.fixture(scope="session")
def shared_table_model_dir(tmp_path_factory):
    """A small random model whose 24 expert files share one section table (read only):
    hidden 64, group 64, layer 0 dense, layers 1-3 MoE (8 experts, top-2, no shared one)."""
    from colibri_core.model.testing import write_random_model
    d = tmp_path_factory.mktemp("shared_table") / "m"
    write_random_model(d, hidden=64, heads=2, kv_heads=1, inter=64, moe_inter=64, vocab=64,
                       group=64, shared=0, context=64, experts=8, top_k=2,
                       layers=("dense", "moe", "moe", "moe"))
    return d


@pytest.fixture
def model(tiny_model_dir, tmp_path):
    """A private copy of the tiny model, free to damage."""
    from robust_helpers import copy_model
    return copy_model(tiny_model_dir, tmp_path / "m")


# -- plugin tests ----------------------------------------------------------------------

@pytest.fixture
def pm():
    """A plugin manager with no plugins (no entry points, no built-ins)."""
    from colibri_core.plugins import build_plugin_manager
    return build_plugin_manager(load_entrypoints=False, builtins=(), environ={})


@pytest.fixture
def relay(pm):
    from colibri_core.plugins import HookRelay
    return HookRelay(pm)


@pytest.fixture
def pipe():
    """A pipe (read fd, write fd) for trace output, closed after the test."""
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


@pytest.fixture(scope="module")
def eng():
    """The built-in model on one thread, shared by a module's tests."""
    from colibri_core.engine import Engine
    with Engine.from_config("builtin", threads=1) as e:
        yield e
