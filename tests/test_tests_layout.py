"""The test suite's own layout: helpers, fixtures and constants live in conftest.py and the support modules beside it
(models.py, servers.py, reference.py, ...), so no module of tests/ imports from a test module."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (test_*, or anything under `tests.`) that `path` imports, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [name for name in names if name.split(".")[0].startswith("test_") or name.startswith("tests.")]
    return found


def test_no_module_imports_from_a_test_module():
    imports = {path.name: imported for path in sorted(TESTS.glob("*.py")) if (imported := imported_test_modules(path))}
    assert imports == {}, "move what these share into conftest.py or a support module"


def test_the_finder_sees_such_imports(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text("import os\nfrom test_serve import Served\n\ndef f():\n    from tests.reference import require\n")
    assert imported_test_modules(module) == ["test_serve", "tests.reference"]
