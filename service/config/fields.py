"""The one field helper every section uses: a default with its documentation, and the
check that names the section and field when a value is refused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any


def documented(default: Any, doc: str, *, checked_by: str = "") -> Any:
    """A field with a default and its documentation (meaning, unit), which the example
    config prints. `checked_by`: the class whose check of an enum-like (Literal) value
    gives the message users see; the TOML loader then only requires a string and leaves
    the value to the section's `__post_init__`."""
    metadata = {"doc": doc, "checked_by": checked_by} if checked_by else {"doc": doc}
    return field(default=default, metadata=metadata)


def require(condition: bool, section: str, name: str, message: str) -> None:
    """ValueError "[section] name: message" unless `condition` holds."""
    if not condition:
        raise ValueError(f"[{section}] {name}: {message}")


def requirement(section: str) -> Callable[[bool, str, str], None]:
    """`require` bound to one section, for a module that holds only that section."""

    def check(condition: bool, name: str, message: str) -> None:
        require(condition, section, name, message)

    return check
