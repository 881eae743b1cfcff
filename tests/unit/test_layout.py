"""The source layout's rules: every import allowed by the layer rules of the module map
(docs/design/modules.md, "Layer rules": which package may import which), no import circle
among stoker's modules (imports inside functions included, for both), no module above 600
lines unless the design page says why, and a wheel that holds the library and the doctor,
none of the benchmark harness (benchmarks/stoker_bench)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
MAX_LINES = 600
MODULE_MAP = ROOT / "docs" / "design" / "modules.md"
CLI = {"stoker._cli", "stoker.__main__"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The stoker modules `path` imports, anywhere in it (a package import counts as its
    __init__; `from package import module` as that module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    known = set(paths)
    return {name: _imports(path, name, known) for name, path in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_stokers_modules() -> None:
    graph = _graph()
    assert "stoker._core.arena" in graph and "stoker._core.protocol" in graph["stoker._core.arena"]
    assert _cycles(graph) == []


def _layer(module: str) -> str:
    """The layer a module belongs to, as the layer rules name it: its package under stoker,
    `public` for the modules directly in stoker, `_cli` for the command line."""
    if module in CLI:
        return "_cli"
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and not (SRC / "stoker" / parts[1]).is_dir()):
        return "public"
    return parts[1]


def _layer_rules(page: str) -> dict[str, set[str]]:
    """The module map's table of layer rules: each package and the packages it may import."""
    section = page.split("## Layer rules", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        rules[cells[0].split("`")[1]] = set(re.findall(r"`([^`]+)`", cells[1]))
    return rules


def _broken(graph: dict[str, set[str]], rules: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
        for module, targets in graph.items()
        for target in targets
        if _layer(target) != _layer(module) and _layer(target) not in rules.get(_layer(module), set())
    )


def test_the_import_reader_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from .._core import loader\n    import stoker._mix\n")
    known = {"stoker._core", "stoker._core.loader", "stoker._mix", "stoker._shards"}
    assert _imports(module, "stoker._shards.m", known) == {"stoker._core", "stoker._core.loader", "stoker._mix"}


def test_the_layer_check_finds_an_import_that_points_up() -> None:
    rules = {"_base": set(), "_data": {"_base"}, "_core": {"_base", "_data"}}
    graph = {"stoker._data.a": {"stoker._base.b"}, "stoker._base.b": {"stoker._core.c"}, "stoker._core.c": set()}
    assert _broken(graph, rules) == ["stoker._base.b (_base) imports stoker._core.c (_core)"]


def test_the_layer_rules_cover_every_package_and_point_down() -> None:
    rules = _layer_rules(MODULE_MAP.read_text())
    layers = {_layer(module) for module in _graph()}
    assert set(rules) == layers, (
        f"packages without a row in the layer rules: {sorted(layers - set(rules))}; "
        f"rows for no package: {sorted(set(rules) - layers)}"
    )
    named = set().union(*rules.values())
    assert named <= layers, f"the layer rules name unknown packages: {sorted(named - layers)}"
    assert _cycles(rules) == [], "the layer rules make a circle"
    # the promises of the design page, which the table may not loosen
    assert rules["_base"] == set(), "_base imports nothing of stoker"
    assert "_core" not in rules["_shards"] | rules["_mix"], "_shards and _mix import nothing of _core"
    assert [layer for layer, allowed in rules.items() if "_doctor" in allowed] == ["_cli"], (
        "nothing below imports _doctor"
    )
    assert "_data" not in rules["_base"] and "_core" not in rules["_data"]


def test_every_import_follows_the_layer_rules() -> None:
    broken = _broken(_graph(), _layer_rules(MODULE_MAP.read_text()))
    assert not broken, "imports the layer rules of docs/design/modules.md do not allow:\n" + "\n".join(broken)


def test_modules_above_600_lines_are_explained_on_the_design_page() -> None:
    page = (ROOT / "docs" / "design" / "modules.md").read_text()
    section = page.split("## Files above 600 lines", 1)[1].split("\n## ", 1)[0]
    explained = set(re.findall(r"`([\w/]+\.py)`", section))
    long = {
        str(path.relative_to(SRC / "stoker")): len(path.read_text().splitlines())
        for path in SRC.rglob("*.py")
        if len(path.read_text().splitlines()) > MAX_LINES
    }
    unexplained = {path: lines for path, lines in long.items() if path not in explained}
    assert not unexplained, f"modules above {MAX_LINES} lines without a reason in docs/design/modules.md: {unexplained}"


def test_the_wheel_holds_the_library_and_the_doctor_only(tmp_path: Path) -> None:
    """The wheel built from a copy of the project (offline, with the setuptools installed here:
    about 2 s) has stoker's modules and the doctor, and no benchmark module."""
    pytest.importorskip("setuptools", minversion="77")  # pyproject.toml's build requirement
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(SRC, project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(project),
        ],
        check=True,
        capture_output=True,
        timeout=100,
    )
    (wheel,) = (tmp_path / "dist").glob("stoker-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    modules = {PurePosixPath(name).stem for name in names if name.endswith(".py")}
    assert {"stoker/__init__.py", "stoker/__main__.py", "stoker/_doctor/__init__.py", "stoker/_cli.py"} <= set(names)
    assert {name.split("/")[0] for name in names} == {"stoker", wheel.name.rsplit("-", 3)[0] + ".dist-info"}
    assert not modules & {"bench", "gpubench", "raybench", "jpegbench", "startbench"}
    assert not [name for name in names if "bench" in name or "_tools" in name]
    assert "stoker = stoker._cli:main" in entry_points and "bench" not in entry_points
