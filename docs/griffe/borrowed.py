"""A griffe extension for the API reference (mkdocs.yml loads it; so does
tests/unit/test_reference.py): a class whose body borrows another class's docstring or
constructor, `__doc__ = Other.__doc__` or `__init__ = Other.__init__` (as stoker.torch's
DataLoader, datasets and samplers do), is documented with them, as `help()` shows it.

griffe reads the source without importing it, so on its own it sees those lines as plain
attributes: the class would have no docstring and a signature without parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import griffe

BORROWED = re.compile(r"^(?P<source>[\w.]+)\.(?P<attr>__doc__|__init__)$")


def _classes(module: Any) -> Iterator[Any]:
    for member in module.members.values():
        if member.is_alias:
            continue
        if member.is_module:
            yield from _classes(member)
        elif member.is_class:
            yield member


def borrowed(cls: Any, attr: str) -> Any | None:
    """What `cls.<attr> = Other.<attr>` in the class body borrows: Other (for `__doc__`) or
    Other's `__init__`; None when the class does not borrow it or Other is not stoker's."""
    member = cls.members.get(attr)
    if member is None or member.is_alias or not member.is_attribute or member.value is None:
        return None
    match = BORROWED.match(str(member.value))
    if match is None:
        return None
    head, *rest = match["source"].split(".")
    try:
        source = cls.module[head]
        for part in rest:
            source = source[part]
        source = source.final_target if source.is_alias else source
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    if not source.is_class:
        return None
    if attr == "__doc__":
        return source
    init = source.members.get("__init__")
    return init if init is not None and init.is_function else None


class BorrowedDocs(griffe.Extension):
    """Give a class the docstring and the `__init__` its body borrows from another class."""

    def on_package(self, *, pkg: Any, loader: Any, **kwargs: Any) -> None:
        for cls in _classes(pkg):
            source = borrowed(cls, "__doc__")
            if source is not None and cls.docstring is None and source.docstring is not None:
                doc = source.docstring
                cls.docstring = griffe.Docstring(
                    doc.value,
                    lineno=doc.lineno,
                    endlineno=doc.endlineno,
                    parent=cls,
                    parser=doc.parser,
                    parser_options=doc.parser_options,
                )
                cls.del_member("__doc__")
            init = borrowed(cls, "__init__")
            if init is not None:
                cls.del_member("__init__")
                cls.set_member("__init__", griffe.Alias("__init__", init, parent=cls))
