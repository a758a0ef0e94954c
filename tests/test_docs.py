"""The documents against the code: docs/api.md names every argument of every
front door with the default the code declares, every relative link in README.md
and docs/ leads to a file (and a heading) that exists, every repository path the
documents cite exists, the tests docs/design.md names as invariants exist, and
the code cites docs/, not a design file that is not in the repository."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import re

import pytest

import layerwise


def _root() -> pathlib.Path:
    for parent in pathlib.Path(__file__).resolve().parents:
        if (parent / "layerwise").is_dir() and (parent / "README.md").is_file():
            return parent
    raise RuntimeError("the repository root (layerwise/ and README.md) is not above this test")


ROOT = _root()
DOCS = ROOT / "docs"
API = DOCS / "api.md"


# ---------------------------------------------------------------- docs/api.md
def _section(text: str, title: str) -> str:
    """The text under the heading that names `title` in backquotes (`### \\`title\\``),
    up to the next heading (a method's own heading ends its class's section)."""
    lines = text.splitlines()
    for k, line in enumerate(lines):
        m = re.match(r"^(#+)\s+`([^`]+)`\s*$", line)
        if m and m.group(2) == title:
            out = []
            for nxt in lines[k + 1:]:
                if re.match(r"^#+\s", nxt):
                    break
                out.append(nxt)
            return "\n".join(out)
    raise AssertionError(f"docs/api.md has no heading `{title}`")


def _rows(section: str) -> dict[str, str]:
    """{argument: default cell} of the section's tables (| `name` | default | ... |)."""
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\|\s*`([A-Za-z_]\w*)`\s*\|\s*([^|]*?)\s*\|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def _model_report():
    for name in ("layerwise.reporting", "layerwise.report"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if inspect.ismodule(mod) and callable(getattr(mod, "report", None)):
            return mod.report
    raise AssertionError("no module layerwise.reporting (or layerwise.report) with report(model, ...)")


_scatter_kernels = importlib.import_module("layerwise.triton_kernels.scatter")
M = layerwise.LayerwiseOffloadManager
# (section title, callable, only the parameters that have a default)
SIGNATURES = [
    ("configure_layerwise_offload", layerwise.configure_layerwise_offload, False),
    ("remove_layerwise_offload", layerwise.remove_layerwise_offload, False),
    ("load_offloaded", layerwise.load_offloaded, False),
    ("empty_model", layerwise.empty_model, False),
    ("offload_pipeline", layerwise.offload_pipeline, False),
    ("remove_pipeline_offload", layerwise.remove_pipeline_offload, False),
    ("report", layerwise.report, False),
    ("report", _model_report(), True),  # layerwise.report(model, ...) passes its keywords on
    ("report_pipeline", layerwise.report_pipeline, False),
    ("tune", layerwise.tune, False),
    ("detect_layer_groups", layerwise.detect_layer_groups, False),
    ("OffloadOptions", layerwise.OffloadOptions.build, False),
    ("build_info", layerwise.build_info, False),
    ("scatter_segment", layerwise.scatter_segment, False),
    ("build_scatter_table", layerwise.build_scatter_table, False),
    ("build_scatter_table", _scatter_kernels.build_scatter_table, False),  # (the wrapper passes **kwargs on)
    ("LayerwiseOffloadManager", M.__init__, False),
    ("LayerwiseOffloadManager.stats", M.stats, False),
    ("LayerwiseOffloadManager.set_residency", M.set_residency, False),
    ("LayerwiseOffloadManager.remove", M.remove, False),
    ("LayerwiseOffloadManager.initialize", M.initialize, False),
    ("LayerwiseOffloadManager.tier_plan", M.tier_plan, False),
    ("LayerwiseOffloadManager.fetch_bytes", M.fetch_bytes, False),
    ("LayerwiseOffloadManager._initialize_layer_weights", M._initialize_layer_weights, False),
    ("LayerwiseOffloadManager._finalize_initialization", M._finalize_initialization, False),
]
# Checked where the tree has them; a public one is in layerwise.__all__, whose every name
# needs a heading in docs/api.md in any case (test_every_public_name_has_a_heading_in_api_md).
for _title, _owner, _name in (("is_offloaded", layerwise, "is_offloaded"), ("managers_of", layerwise, "managers_of"),
                              ("LayerwiseOffloadManager._managed_parameter_bytes", M, "_managed_parameter_bytes")):
    if hasattr(_owner, _name):
        SIGNATURES.append((_title, getattr(_owner, _name), False))


@pytest.mark.parametrize("title, fn, with_default_only", SIGNATURES,
                         ids=[f"{t}{'-keywords' if d else ''}" for t, _, d in SIGNATURES])
def test_api_md_lists_every_argument_with_its_default(title, fn, with_default_only):
    assert fn is not None, f"{title} is named in docs/api.md but the code has no such callable"
    rows = _rows(_section(API.read_text(), title))
    wrong = []
    for name, p in inspect.signature(fn).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if with_default_only and p.default is p.empty:
            continue
        if name not in rows:
            wrong.append(f"{name}: missing")
            continue
        want = "required" if p.default is p.empty else f"`{p.default!r}`"
        if rows[name] != want:
            wrong.append(f"{name}: the code's default is {want}, docs/api.md says {rows[name]}")
    assert not wrong, f"docs/api.md, `{title}` disagrees with {fn.__qualname__}{inspect.signature(fn)}: {wrong}"


def test_api_md_lists_every_streaming_option_at_every_front_door_that_takes_it():
    """The options a front door takes through **options are listed beside its own
    arguments, with the defaults OffloadOptions gives them."""
    text = API.read_text()
    fields = {f.name: f for f in dataclasses.fields(layerwise.OffloadOptions)}
    for title in ("configure_layerwise_offload", "load_offloaded", "offload_pipeline", "OffloadOptions"):
        rows = _rows(_section(text, title))
        for name, f in fields.items():
            assert name in rows, f"docs/api.md, `{title}`: the option {name!r} is missing"
            if name == "device":  # (a field without a default; the front doors resolve None to the default device)
                want = "required" if title == "OffloadOptions" else "`None`"
            else:
                want = f"`{f.default!r}`"
            assert rows[name] == want, f"docs/api.md, `{title}`: {name} default {rows[name]}, the code's {want}"


def test_api_md_lists_every_field_of_the_tune_plan():
    rows = _rows(_section(API.read_text(), "TunePlan"))
    names = [f.name for f in dataclasses.fields(layerwise.TunePlan)] + ["predicted_step_s", "measured_step_s"]
    missing = [n for n in names if n not in rows]
    assert not missing, f"docs/api.md, `TunePlan` lacks {missing}"


def test_every_public_name_has_a_heading_in_api_md():
    text = API.read_text()
    headed = {n for line in re.findall(r"^#+\s.*$", text, flags=re.M) for n in re.findall(r"`([A-Za-z_]\w*)`", line)}
    missing = [n for n in layerwise.__all__ if n not in headed]
    assert not missing, f"layerwise.__all__ names {missing}, which docs/api.md does not document"


# ---------------------------------------------------------------------- links
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, backquotes and punctuation dropped,
    spaces to hyphens."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    out, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"^#+\s+(.*)$", line)
        if m and not in_code:
            out.add(_slug(m.group(1)))
    return out


def _documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]


def test_docs_exist():
    names = {p.name for p in DOCS.glob("*.md")}
    for page in ("design.md", "api.md", "pipelines.md", "disk-tier.md", "compression.md", "split-fetch.md",
                 "quantized.md", "moe.md", "tune.md", "loading.md", "supported.md", "gpu-status.md",
                 "simulated-bus.md", "telemetry.md"):
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings_that_exist(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # (links inside code blocks are code)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = doc if not path else (doc.parent / path).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 260, f"README.md has {lines} lines: keep it a page (the rest belongs in docs/)"


# ------------------------------------------------------------ design.md tests
def _named_invariant_tests() -> list[str]:
    text = (DOCS / "design.md").read_text()
    section = text.split("## Invariants", 1)[1].split("\n## ", 1)[0]
    return sorted(set(re.findall(r"`(test_\w+)`", section)))


def test_every_invariant_test_named_in_design_md_exists():
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^\s*def (test_\w+)", path.read_text(), flags=re.M))
    named = _named_invariant_tests()
    assert named, "docs/design.md, Invariants names no test"
    missing = [t for t in named if t not in defined]
    assert not missing, f"docs/design.md, Invariants names tests that do not exist: {missing}"


def test_the_test_folders_design_md_names_exist():
    text = (DOCS / "design.md").read_text()
    section = text.split("## Invariants", 1)[1].split("\n## ", 1)[0]
    folders = sorted(set(re.findall(r"`(tests/[\w/]+/)`", section)))
    missing = [f for f in folders if not (ROOT / f).is_dir()]
    assert not missing, f"docs/design.md, Invariants names test folders that do not exist: {missing}"


# ------------------------------------------------------------------ citations
def test_no_file_in_the_package_cites_a_design_file_outside_the_repository():
    citing = []
    files = [p for top in ("layerwise", "csrc", "triton_kernels", "scripts") for p in (ROOT / top).rglob("*")]
    for path in sorted(set(files)):
        if path.is_symlink() or not path.is_file() or path.suffix in (".so", ".pyc"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        n = text.count("DESIGN.md")
        if n:
            citing.append(f"{path.relative_to(ROOT)} ({n})")
    assert not citing, f"these files cite DESIGN.md, which is not in the repository (cite docs/design.md): {citing}"


# ---------------------------------------------------------------- cited paths
_TOP = ("layerwise", "csrc", "triton_kernels", "scripts", "bench", "tests")
_PACKAGE = ("planning", "runtime", "contract", "stages", "codec", "formats")
_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(_TOP + _PACKAGE))


def _cited_paths(doc: pathlib.Path) -> list[str]:
    """The repository paths a document names (`layerwise/stages/source.py`, and a
    path inside the package written from its folder down, `stages/disk/source.py`).
    A test folder (`tests/runtime/`) is the design's layout, checked on its own
    (test_the_test_folders_design_md_names_exist)."""
    return sorted({p for p in _PATH.findall(doc.read_text())
                   if not (p.startswith("tests/") and p.endswith("/"))})


def _exists(cited: str) -> bool:
    top = cited.split("/", 1)[0]
    root = ROOT if top in _TOP else ROOT / "layerwise"
    return (root / cited.rstrip("/")).exists()


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_cites_exists(doc):
    missing = [p for p in _cited_paths(doc) if not _exists(p)]
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist: {missing}"


def test_the_cited_path_check_sees_paths():
    cited = _cited_paths(DOCS / "design.md")
    assert "layerwise/options.py" in cited and "stages/disk/source.py" in cited, cited
    assert not _exists("layerwise/no_such_module.py") and not _exists("stages/no_such_stage.py")


def test_every_file_the_layout_table_names_exists():
    """docs/design.md, "Where things live": a folder's row names its files bare
    (`reader.py`); each one is in that folder (or a folder below it)."""
    text = (DOCS / "design.md").read_text()
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    missing = []
    for folder, cell in re.findall(r"^\|\s*`([\w/]+/)`\s*\|(.*)\|\s*$", section, flags=re.M):
        for name in re.findall(r"`([\w.]+\.(?:py|cpp|h|cu))`", cell):
            if not any((ROOT / folder).rglob(name)):
                missing.append(f"{folder}{name}")
    assert not missing, f"docs/design.md, Where things live, names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dotted_name_a_document_cites_resolves(doc):
    """`layerwise.codec.parse_header`, `layerwise.planning.host_limits.budget_memory_bytes`:
    a module, then attributes, that exist."""
    wrong = []
    for name in sorted(set(re.findall(r"`(layerwise(?:\.[A-Za-z_]\w*)+)", doc.read_text()))):
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:k]))
            except ImportError:
                continue
            try:
                for attr in parts[k:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                wrong.append(name)
            break
    assert not wrong, f"{doc.relative_to(ROOT)} names what the package does not have: {wrong}"
