"""The API reference reads as a user needs it: the docstrings of every public name, parsed as
mkdocstrings parses them (griffe, Google style), document every parameter, state the
signature's defaults, and name no private module.

Public: what the `__all__` of `stoker`, `stoker.torch`, `stoker.vision`, `stoker.ray` and
`stoker.testing` exports; of a class, its `__init__` parameters (documented on the class, as
`merge_init_into_class` renders them) and its methods whose names do not start with `_`.
Names that are torch's or numpy's own objects are not stoker's to document and are skipped.

Conventions checked:

- `Args:` has one entry per parameter, `name: Meaning.`; where the signature gives a
  default, the entry says `Defaults to X.` with X written as in the signature (a module
  constant may be written as its value). `self`, `cls`, `*args` and `**kwargs` need no entry;
  a variadic parameter with another name (`**options`) does.
- No docstring (nor the module docstrings) names a private module: `_core`, `_data`,
  `_doctor`, `_vision`, `_frameworks`, `stoker._...`; nor do the pages a user reads (the
  README, getting started, the guides, the reference and performance pages).

The package is loaded with the griffe extensions mkdocs.yml gives mkdocstrings (a class body's
`__doc__ = Other.__doc__` is its docstring, as in help()). The test reports every offender at
once.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

griffe = pytest.importorskip("griffe")

SRC = Path(__file__).resolve().parents[2] / "src"
PUBLIC_MODULES = (
    "stoker",
    "stoker.torch",
    "stoker.vision",
    "stoker.shards",
    "stoker.mix",
    "stoker.ray",
    "stoker.testing",
)
PRIVATE_MODULE = re.compile(r"(?<![A-Za-z0-9_.])_(core|data|doctor|vision|frameworks|stream)\b|stoker\._")
DEFAULT = re.compile(r"Defaults\s+to\s+(?P<value>.+?)\.(?=\s|$)", re.DOTALL)
UNDOCUMENTED_VARIADICS = {"args", "kwargs"}
ROOT = SRC.parent
# the griffe extensions mkdocs.yml gives mkdocstrings (paths from the repository root)
EXTENSIONS = ("docs/griffe/borrowed.py",)


def _load(search_path: Path = SRC) -> Any:
    """The package as mkdocstrings loads it for the reference pages."""
    config = (ROOT / "mkdocs.yml").read_text()
    for extension in EXTENSIONS:
        assert f"- {extension}" in config, f"mkdocs.yml no longer loads {extension}: update EXTENSIONS"
    return griffe.load(
        "stoker",
        search_paths=[str(search_path)],
        docstring_parser="google",
        resolve_aliases=True,
        resolve_external=False,
        extensions=griffe.load_extensions(*(str(ROOT / extension) for extension in EXTENSIONS)),
    )


def _target(obj: Any) -> Any | None:
    """The object an alias stands for, or None when it lies outside stoker (torch, numpy)."""
    if obj.is_alias:
        try:
            obj = obj.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    if not obj.path.startswith("stoker"):
        return None
    value = getattr(obj, "value", None)
    if obj.is_attribute and value is not None and _names_foreign(obj, str(value)):
        return None  # `Dataset = torch.utils.data.Dataset`
    return obj


def _names_foreign(obj: Any, expression: str) -> bool:
    """Whether an attribute's value is a name imported from outside stoker."""
    head = expression.split(".")[0]
    module = obj.module
    if head not in module.members:
        return False
    member = module.members[head]
    return bool(member.is_alias and not member.target_path.startswith("stoker"))


def _init_of(cls: Any) -> Any | None:
    """The `__init__` whose parameters the class's reference shows, if stoker's."""
    init = cls.all_members.get("__init__")
    if init is None:
        return None
    if init.is_alias:
        try:
            init = init.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    return init if init.is_function and init.path.startswith("stoker") else None


def _documented(docstring: Any | None) -> dict[str, str]:
    """Parameter name -> description, from the docstring's Args sections."""
    if docstring is None:
        return {}
    entries: dict[str, str] = {}
    for section in docstring.parse("google", warnings=False):
        if section.kind is griffe.DocstringSectionKind.parameters:
            for parameter in section.value:
                entries[parameter.name.lstrip("*")] = parameter.description or ""
    return entries


def _literal(text: str) -> Any:
    try:
        return ("value", ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return ("text", text.strip("`"))


def _default_value(owner: Any, text: str) -> set[Any]:
    """Ways a signature's default may be written: as in the signature, or (a module constant)
    as the constant's value."""
    written = {_literal(text)}
    member = owner.module.members.get(text) if text.isidentifier() else None
    if member is not None and member.is_attribute and member.value is not None:
        written.add(_literal(str(member.value)))
    return written


def _check_parameters(where: str, function: Any, docstrings: list[Any], offenders: list[str]) -> None:
    documented: dict[str, str] = {}
    for docstring in docstrings:
        documented.update(_documented(docstring))
    names = set()
    for parameter in function.parameters:
        name = parameter.name
        names.add(name)
        if name in {"self", "cls"}:
            continue
        variadic = parameter.kind in {
            griffe.ParameterKind.var_positional,
            griffe.ParameterKind.var_keyword,
        }
        if variadic and name in UNDOCUMENTED_VARIADICS:
            continue
        description = documented.get(name, "").strip()
        if not description:
            offenders.append(f"{where}: parameter {name!r} has no description")
            continue
        found = DEFAULT.search(description)
        if parameter.default is None or variadic:
            if found is not None:
                offenders.append(f"{where}: {name!r} documents a default ({found['value']}) the signature lacks")
            continue
        signature = str(parameter.default)
        if found is None:
            offenders.append(f"{where}: {name!r} does not say 'Defaults to {signature}.'")
        elif _literal(found["value"]) not in _default_value(function, signature):
            offenders.append(
                f"{where}: {name!r} documents 'Defaults to {found['value']}', the signature has {signature}"
            )
    for name in documented:
        if name not in names:
            offenders.append(f"{where}: documents {name!r}, which is not a parameter")


def _check_text(where: str, docstring: Any | None, offenders: list[str]) -> None:
    if docstring is None:
        return
    for match in PRIVATE_MODULE.finditer(docstring.value):
        line = docstring.value[: match.start()].count("\n") + 1
        offenders.append(f"{where}: docstring line {line} names a private module ({match.group(0)!r})")


def _methods(cls: Any) -> Iterator[tuple[str, Any]]:
    for name, member in cls.all_members.items():
        try:
            target = member.final_target if member.is_alias else member
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        if not target.path.startswith("stoker"):
            continue
        if target.is_function or target.is_attribute:
            yield name, target


def _offenders(package: Any, modules: tuple[str, ...] = PUBLIC_MODULES) -> list[str]:
    offenders: list[str] = []
    seen: set[str] = set()
    for module_name in modules:
        module = package if module_name == "stoker" else package[module_name.split(".", 1)[1]]
        _check_text(module_name, module.docstring, offenders)
        for export in module.exports or ():
            name = str(export)
            where = f"{module_name}.{name}"
            obj = _target(module[name])
            if obj is None:
                continue
            if obj.path in seen:  # stoker.torch re-exports stoker's own objects
                continue
            seen.add(obj.path)
            docstring = obj.docstring
            if docstring is None and not obj.is_attribute:
                offenders.append(f"{where}: no docstring")
            _check_text(where, docstring, offenders)
            if obj.is_function:
                _check_parameters(where, obj, [docstring], offenders)
            elif obj.is_class:
                init = _init_of(obj)
                if init is None and _documented(docstring):
                    # mkdocstrings takes a class's signature from its __init__ alone
                    offenders.append(f"{where}: documents Args, but has no __init__ to show them with")
                if init is not None:
                    _check_parameters(where, init, [docstring, init.docstring], offenders)
                    _check_text(f"{where}.__init__", init.docstring, offenders)
                for method_name, method in _methods(obj):
                    if method_name == "__init__":
                        continue
                    method_where = f"{where}.{method_name}"
                    if method_name.startswith("_"):
                        _check_text(method_where, method.docstring, offenders)
                        continue
                    is_method = method.is_function and "property" not in method.labels
                    if method.docstring is None:
                        if is_method or "property" in method.labels:
                            offenders.append(f"{method_where}: no docstring")
                        continue
                    _check_text(method_where, method.docstring, offenders)
                    if is_method:
                        _check_parameters(method_where, method, [method.docstring], offenders)
    return offenders


def test_public_docstrings_document_every_parameter_without_private_paths() -> None:
    offenders = _offenders(_load())
    assert not offenders, f"{len(offenders)} reference problem(s):\n" + "\n".join(offenders)


BAD_PACKAGE = '''
"""A package whose reference has one of each problem the check reports."""

__all__ = ["Loader", "load", "fine"]


def load(path: str, retries: int = 3, *, strict: bool = False) -> None:
    """Load a file.

    Args:
        path: Where the file is.
        retries: How often to try again. Defaults to 5.
    """


def fine(count: int = 2) -> int:
    """Count.

    Args:
        count: How many. Defaults to 2.

    Returns:
        The count.
    """
    return count


class Loader:
    """Loads; the work is done in _core/loader.py.

    Args:
        size: The size.
        gone: A parameter the signature no longer has.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size

    def step(self, n: int) -> None:
        """One step."""
'''


USER_PAGES = (
    "README.md",
    "docs/index.md",
    "docs/getting-started.md",
    "docs/performance.md",
    "docs/guide/*.md",
    "docs/reference/*.md",
)


def test_user_pages_name_no_private_module() -> None:
    """The pages a user reads (not the design pages, which map the private modules) send
    nobody to a private module."""
    offenders = []
    for pattern in USER_PAGES:
        for page in sorted(ROOT.glob(pattern)):
            text = page.read_text()
            for match in PRIVATE_MODULE.finditer(text):
                line = text[: match.start()].count("\n") + 1
                offenders.append(f"{page.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not offenders, "user pages naming a private module:\n" + "\n".join(offenders)


def test_the_check_reports_each_kind_of_problem(tmp_path: Path) -> None:
    """The check itself can fail: a package with an undocumented parameter, a default that
    differs from the signature's, a default left unsaid, a documented name that is no
    parameter and a private module in the text is reported for each, and nothing else."""
    (tmp_path / "stoker").mkdir()
    (tmp_path / "stoker" / "__init__.py").write_text(BAD_PACKAGE)
    offenders = _offenders(_load(tmp_path), modules=("stoker",))
    assert sorted(offenders) == sorted(
        [
            "stoker.load: 'retries' documents 'Defaults to 5', the signature has 3",
            "stoker.load: parameter 'strict' has no description",
            "stoker.Loader: 'size' does not say 'Defaults to 4.'",
            "stoker.Loader: documents 'gone', which is not a parameter",
            "stoker.Loader: docstring line 1 names a private module ('_core')",
            "stoker.Loader.step: parameter 'n' has no description",
        ]
    )
