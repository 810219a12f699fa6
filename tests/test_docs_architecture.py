"""docs/architecture.md names only modules that exist: every `minimlx/...` path (and every `archs/x.py`-style path
under one of minimlx's packages) is a file or folder of the package, and every dotted `minimlx.x.y` name imports,
down to its last attribute."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = sorted(p.name for p in (ROOT / "minimlx").iterdir() if (p / "__init__.py").is_file())
PATH = re.compile(r"(?<![\w./-])((?:minimlx|" + "|".join(PACKAGES) + r")/(?:[\w/]*\w(?:\.py)?/?)?)")
DOTTED = re.compile(r"(?<![\w.])(minimlx(?:\.\w+)+)")


def named_paths(text: str) -> list[str]:
    return sorted({m if m.startswith("minimlx/") else f"minimlx/{m}" for m in PATH.findall(text)})


def named_modules(text: str) -> list[str]:
    return sorted(set(DOTTED.findall(text)))


def resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or a module's attribute (of an attribute ...)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def test_the_page_names_modules_and_the_patterns_find_them():
    text = PAGE.read_text()
    assert "minimlx/core/transformer.py" in named_paths(text)
    assert named_paths("`cpu/forms.py`, minimlx/decode/ and `core/`") == [
        "minimlx/core/",
        "minimlx/cpu/forms.py",
        "minimlx/decode/",
    ]
    assert named_modules("`minimlx.archs` entry points, minimlx.anatomy.lens.logit_lens.") == [
        "minimlx.anatomy.lens.logit_lens",
        "minimlx.archs",
    ]
    assert not resolves("minimlx.anatomy.nothing") and resolves("minimlx.anatomy.lens.logit_lens")


@pytest.mark.parametrize("path", named_paths(PAGE.read_text()))
def test_every_named_path_exists(path):
    assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which does not exist"


@pytest.mark.parametrize("dotted", named_modules(PAGE.read_text()))
def test_every_dotted_name_imports(dotted):
    assert resolves(dotted), f"docs/architecture.md names {dotted}, which does not import"


def test_the_layout_lists_every_module_and_package():
    """The tree of `minimlx/` at the top of the page lists each top-level module and package."""
    tree = PAGE.read_text().split("```\nminimlx/\n", 1)[1].split("```", 1)[0]
    listed = set(re.findall(r"^  (\w+(?:\.py|/))", tree, re.M))
    present = {p.name + "/" for p in (ROOT / "minimlx").iterdir() if (p / "__init__.py").is_file()}
    present |= {p.name for p in (ROOT / "minimlx").glob("*.py")}
    assert not present - listed, f"the layout leaves out {', '.join(sorted(present - listed))}"
    assert not listed - present, f"the layout lists {', '.join(sorted(listed - present))}, which minimlx does not hold"
