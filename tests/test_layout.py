"""The tests' own layout: test modules in folders that mirror the source, shared
code in tests/helpers/ (fixture modules), no test module or conftest.py imported
by another module (nor by a script a test runs), and test file names unique
across the folders (pytest imports each test module by its file name, with its
folder on sys.path)."""
import collections
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
HELPERS = TESTS / "helpers"

# An import of a test module, as a statement or in a script a test writes out: `from
# test_x import ...`, `import os, test_x as t`, `from tests.test_x import ...`, `from
# tests.stages import (a,\n test_x)`, `importlib.import_module("test_x")`; and of a
# conftest.py (several folders have one: which one `import conftest` finds depends on the
# order pytest imported them). A name test_* imported from anywhere counts too: pytest
# would collect that function a second time in the importing module.
_MODULE = r"(?:[\w.]+\.)?(?:test_\w+|conftest)\b"
IMPORTS_A_TEST = re.compile(
    rf"^\s*(?:from\s+{_MODULE}|import\s+(?:[\w.]+\s*(?:as\s+\w+\s*)?,\s*)*{_MODULE}"
    r"|from\s+[\w.]+\s+import\s+(?:\([^)]*|[^\n#]*)\b(?:test_\w+|conftest)\b)"
    rf"|import_module\(\s*[\"']{_MODULE}", re.M)


def _python_files():
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_test_module_imports_another_test_module():
    found = []
    for path in _python_files():
        if path == Path(__file__).resolve():
            continue
        for m in IMPORTS_A_TEST.finditer(path.read_text()):
            line = path.read_text().count("\n", 0, m.start()) + 1
            found.append(f"{path.relative_to(TESTS)}:{line}: {m.group(0).strip()}")
    assert not found, "import what they share from tests/helpers/ instead: " + "; ".join(found)


def test_the_pattern_finds_the_imports_it_forbids():
    for text in ("from test_disk_tier import budget", "    from test_moe import _make, _ids",
                 "import test_tune as T", "import os, test_tune", "import os as o, tests.test_tune",
                 "from tests.test_quantized import make", "from stages.test_moe import x",
                 "from tests.stages import test_moe", "from stages import (test_moe)",
                 "from tests.stages import (\n    helpers,\n    test_moe,\n)", "from helpers.x import a, test_b",
                 "    from conftest import cuda_usable", "import conftest", "from stages.conftest import disk_dir",
                 "from stages import conftest", "m = importlib.import_module('test_tune')"):
        assert IMPORTS_A_TEST.search(text), text
    for text in ("from helpers.disk import budget", "from helpers import tune as T", "import layerwise",
                 "def test_x():", "# see tests/test_tune.py", "from helpers.disk import budget  # as test_reader",
                 "from helpers.disk import budget\n\n\ndef test_x(disk_dir):", "import testing_tools",
                 "from helpers import (\n    budget,\n)\n\ndef test_y():"):
        assert not IMPORTS_A_TEST.search(text), text


def test_shared_code_lives_in_helpers_and_test_files_have_unique_names():
    misplaced = [str(p.relative_to(TESTS)) for p in _python_files()
                 if HELPERS not in p.parents and not p.name.startswith("test_") and p.name != "conftest.py"]
    assert not misplaced, f"shared test code belongs in tests/helpers/: {misplaced}"
    in_helpers = [str(p.relative_to(TESTS)) for p in HELPERS.rglob("test_*.py")]
    assert not in_helpers, f"tests/helpers/ holds no tests: {in_helpers}"
    names = collections.Counter(p.name for p in _python_files() if p.name.startswith("test_"))
    assert not [n for n, k in names.items() if k > 1], [n for n, k in names.items() if k > 1]
