"""The package list setup.py installs is every package of the source tree: a
wheel (not an editable install) would otherwise lack a subpackage."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_setup_lists_every_package():
    tree = ast.parse((ROOT / "setup.py").read_text())
    listed = next(ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for k in node.keywords if k.arg == "packages")
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "layerwise").rglob("__init__.py")}
    found.add("layerwise.triton_kernels")  # (installed from triton_kernels/ by package_dir)
    assert set(listed) == found
