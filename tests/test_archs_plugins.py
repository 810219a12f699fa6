"""Architectures registered from outside: the example plugin's imports, broken and clashing plugins, `minimlx archs`."""

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from minimlx.cli import main

ROOT = Path(__file__).resolve().parents[1]
# the example folders that are packages (examples/finetune holds data)
PLUGIN_SOURCES = sorted(p for p in (ROOT / "examples").glob("*/*.py") if (p.parent / "pyproject.toml").is_file())


def private_uses(source: str) -> list[str]:
    """Leading-underscore names the code takes from minimlx (imports) or reaches for (attributes), dunders aside."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "minimlx":
            found += [node.module] if any(private(part) for part in node.module.split(".")) else []
            found += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Import):
            found += [
                a.name for a in node.names if a.name.startswith("minimlx") and any(map(private, a.name.split(".")))
            ]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            found.append(node.attr)
    return found


def test_the_private_name_check_catches_private_imports():
    assert private_uses("from minimlx.archs.registry import _registry") == ["minimlx.archs.registry._registry"]
    assert private_uses("from minimlx.io._files import read") == ["minimlx.io._files"]
    assert private_uses("import minimlx.archs.registry as r\nr._entry_points_loaded = True") == ["_entry_points_loaded"]
    assert private_uses("from minimlx.core import Block\nclass A(Block):\n    def __init__(self): ...") == []


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=lambda p: p.parent.name)
def test_example_plugins_use_only_public_minimlx_names(path):
    source = path.read_text()
    imports = [
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module.startswith("minimlx")
    ]
    assert imports, f"{path} imports nothing from minimlx"
    assert private_uses(source) == []


def test_there_is_an_example_plugin():
    assert [p.relative_to(ROOT).as_posix() for p in PLUGIN_SOURCES] == ["examples/minimlx-olmo2/minimlx_olmo2.py"]


def test_the_tutorial_quotes_the_example_plugin_as_it_is():
    tutorial = (ROOT / "docs" / "adding-an-architecture.md").read_text()
    quotes = re.findall(r"```python\n# (examples/\S+)\n(.*?)```", tutorial, re.S)
    assert len(quotes) == 6
    for path, code in quotes:
        assert code in (ROOT / path).read_text(), f"docs/adding-an-architecture.md quotes {path} wrongly:\n{code}"
    (toml,) = re.findall(r"```toml\n(.*?)```", tutorial, re.S)
    project = (ROOT / "examples/minimlx-olmo2/pyproject.toml").read_text().splitlines()
    assert [line for line in toml.splitlines() if line and line not in project] == []


def fake_distribution(site: Path, name: str, module: str, code: str) -> None:
    """An installed package as importlib.metadata sees it: a module and a dist-info with one minimlx.archs entry
    point."""
    (site / f"{module}.py").write_text(textwrap.dedent(code))
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[minimlx.archs]\n{module} = {module}\n")


@pytest.fixture(scope="module")
def archs_with_bad_plugins(tmp_path_factory):
    """`minimlx archs --json` run with one plugin that raises on import and one that re-registers `llama`."""
    site = tmp_path_factory.mktemp("site")
    fake_distribution(site, "broken-plugin", "broken_plugin", 'raise RuntimeError("this plugin is broken")\n')
    fake_distribution(
        site,
        "llama-again",
        "llama_again",
        """
        from dataclasses import dataclass

        from minimlx import register
        from minimlx.archs.llama3 import Llama3Config


        @register("llama", "llama_again")
        @dataclass
        class LlamaAgain(Llama3Config):
            pass
        """,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "minimlx", "archs", "--json"], env=env, capture_output=True, text=True, timeout=120
    )


def by_model_type(rows: list[dict]) -> dict[str, dict]:
    return {model_type: row for row in rows for model_type in row["model_types"]}


def test_a_plugin_that_fails_to_import_is_skipped_with_a_warning(archs_with_bad_plugins):
    run = archs_with_bad_plugins
    assert run.returncode == 0, run.stderr
    assert (
        "warning: broken-plugin: minimlx plugin 'broken_plugin' failed to load and is skipped "
        "(RuntimeError('this plugin is broken'))" in run.stderr.splitlines()
    )
    rows = by_model_type(json.loads(run.stdout))
    assert {"gpt2", "llama", "qwen3"} <= set(rows)


def test_a_model_type_registered_twice_keeps_the_first_with_a_warning(archs_with_bad_plugins):
    run = archs_with_bad_plugins
    assert run.returncode == 0, run.stderr
    assert (
        "warning: llama-again: model_type 'llama' is already registered by built-in "
        "(minimlx.archs.llama3.Llama3Config); keeping that one" in run.stderr.splitlines()
    )
    rows = by_model_type(json.loads(run.stdout))
    assert rows["llama"]["source"] == "built-in"
    assert rows["llama"]["plugin"] == "minimlx.archs.llama3.Llama3Config"
    assert rows["llama_again"] == {
        "model_types": ["llama_again"],
        "source": "llama-again",
        "plugin": "llama_again.LlamaAgain",
        "parts": ["Attention", "Block", "KVCache", "RMSNorm", "RoPE", "SwiGLU", "Transformer"],
    }


def test_archs_lists_every_built_in_plugin_with_the_core_parts_of_its_example():
    result = CliRunner().invoke(main, ["archs", "--json"])
    assert result.exit_code == 0, result.output
    rows = by_model_type(json.loads(result.output))
    assert rows["gpt2"]["parts"] == ["Attention", "Block", "KVCache", "LayerNorm", "MLP", "Transformer"]
    assert rows["llama"]["parts"] == ["Attention", "Block", "KVCache", "RMSNorm", "RoPE", "SwiGLU", "Transformer"]
    assert {"MoE", "Router", "Experts", "SwiGLU"} <= set(rows["qwen3_moe"]["parts"])
    assert {"LatentAttention", "LatentCache", "MoE"} <= set(rows["deepseek_v3"]["parts"])
    built_in = [r for r in rows.values() if r["source"] == "built-in"]
    assert all(r["parts"] for r in built_in), [r["plugin"] for r in built_in if not r["parts"]]


def test_archs_table_has_one_row_per_plugin():
    result = CliRunner().invoke(main, ["archs"])
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()
    assert header.split()[:4] == ["model_type", "source", "plugin", "core"]
    gpt2 = next(line for line in lines if line.startswith("gpt2 "))
    assert gpt2.split()[1:3] == ["built-in", "minimlx.archs.gpt2.GPT2Config"]
    assert gpt2.endswith("Attention, Block, KVCache, LayerNorm, MLP, Transformer")
    assert any(line.startswith("deepseek_v3, kimi_k2 ") for line in lines)
