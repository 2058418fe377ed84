"""Configs: frozen pydantic models; bad files fail with one line per problem."""
import pytest

from colibri_core.config import (EngineConfig, ModelConfig, find_config, load_run_config,
                                 read_mapping)
from colibri_core.errors import ConfigError


def test_shipped_configs_load():
    for name in ("builtin", "builtin-dynamic-k"):
        cfg, model_dir = load_run_config(find_config(name))
        assert (model_dir / "config.json").exists(), model_dir


def test_unknown_and_bad_fields_one_line_each(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: x\nengine:\n  threads: 0\n  load_mode: disk\n  thraeds: 2\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(p)
    lines = str(e.value).splitlines()
    assert len(lines) == 3
    assert any("field 'engine.threads': value 0" in l and "greater than or equal to 1" in l for l in lines)
    assert any("field 'engine.load_mode': value 'disk'" in l and "'mmap' or 'copy'" in l for l in lines)
    assert any("field 'engine.thraeds'" in l and "unknown field" in l for l in lines)
    assert all(l.startswith(str(p)) for l in lines)


def test_yaml_syntax_error_is_one_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid yaml"):
        read_mapping(p)


def test_missing_config_names_shipped_ones():
    with pytest.raises(ConfigError, match="shipped: .*builtin"):
        find_config("no-such-config")


def test_configs_are_frozen():
    c = EngineConfig()
    with pytest.raises(Exception):
        c.threads = 3


def test_contradictory_model_config():
    with pytest.raises(Exception, match="layer_types has 1 entries, num_layers is 2"):
        ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=64, num_layers=2,
                    num_heads=2, num_kv_heads=2, layer_types=["dense"])
    with pytest.raises(Exception, match="not a multiple of num_kv_heads"):
        ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=64, num_layers=1,
                    num_heads=3, num_kv_heads=2, head_dim=16, layer_types=["dense"])
