"""The TOML side of the config: read a file onto the dataclasses (unknown keys and wrong
types refused, naming the key and its section) and print the resolved config back."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from rlfeed.service.config.sections import FROM_MODEL
from rlfeed.service.config.sidecar import SidecarConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _check_type(section: str, name: str, expected: Any, value: Any) -> Any:
    """`value` as the field's type (`expected`: int, float, str, bool or a Literal of
    strings), or ValueError naming the field."""
    if get_origin(expected) is Literal:
        allowed = get_args(expected)
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(
                f"[{section}] {name}: expected one of {', '.join(map(repr, allowed))}, "
                f"got {value!r}"
            )
        return value
    expected_type = expected
    if expected_type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (expected_type is bool) or not isinstance(value, expected_type):
        raise ValueError(
            f"[{section}] {name}: expected {expected_type.__name__}, got {value!r} "
            f"({type(value).__name__})"
        )
    return value


def _build(cls: type, values: dict[str, Any], section: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    types = get_type_hints(cls)  # the annotations are strings (`from __future__`)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            where = f"section [{section}]" if section else "the top level"
            raise ValueError(
                f"unknown config key {key!r} in {where}; known keys: {', '.join(known)}"
            )
        expected = types[key]
        if dataclasses.is_dataclass(_SECTIONS.get(key)) and not section:
            if not isinstance(value, dict):
                raise ValueError(f"[{key}] must be a table, got {value!r}")
            kwargs[key] = _build(_SECTIONS[key], value, key)
        else:
            if get_origin(expected) is Literal and known[key].metadata.get("checked_by"):
                expected = str  # its owner's check names the allowed values (`documented`)
            kwargs[key] = _check_type(section, key, expected, value)
    return cls(**kwargs)


# Each section's class, by its table name.
_SECTIONS: dict[str, type] = {
    section.name: section.default_factory for section in dataclasses.fields(SidecarConfig)
}


def config_from_dict(values: dict[str, Any]) -> SidecarConfig:
    """Build a SidecarConfig from nested dicts (TOML tables); unknown keys are errors."""
    return _build(SidecarConfig, values, "")


def load_config(path: str | Path | None = None) -> SidecarConfig:
    """Read a TOML file (None = all defaults)."""
    if path is None:
        return SidecarConfig()
    path = Path(path)
    try:
        with path.open("rb") as handle:
            values = tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return config_from_dict(values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def with_overrides(config: SidecarConfig, **sections: dict[str, Any]) -> SidecarConfig:
    """Copy of `config` with some fields replaced, e.g. with_overrides(c, server={"port": 0})."""
    values = config_to_dict(config)
    for section, fields in sections.items():
        values.setdefault(section, {}).update(fields)
    return config_from_dict(values)


def config_to_dict(config: SidecarConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 1_000_000 else str(value)
    raise TypeError(f"cannot write {value!r} as TOML")


def _resolved_attention_weight(config: SidecarConfig) -> str:
    """A comment naming the weight that FROM_MODEL resolves to; empty for explicit ones."""
    if config.batching.attention_weight != FROM_MODEL:
        return ""
    weight, model = config.resolved_attention_weight, config.accounting.model
    return f"  # resolved: {weight:.4g} from {model}'s FLOPs"


def dump_config(config: SidecarConfig, fmt: str = "toml", *, with_docs: bool = False) -> str:
    """The resolved config as TOML (optionally with each field's doc as a comment) or JSON."""
    if fmt == "json":
        return json.dumps(config_to_dict(config), indent=2)
    if fmt != "toml":
        raise ValueError(f"fmt must be 'toml' or 'json', got {fmt!r}")
    lines: list[str] = []
    for section in dataclasses.fields(SidecarConfig):
        values = getattr(config, section.name)
        if lines:
            lines.append("")
        if with_docs:
            lines.append(f"# {type(values).__doc__.strip().splitlines()[0]}")
        lines.append(f"[{section.name}]")
        for item in dataclasses.fields(values):
            if with_docs:
                default = _toml_value(item.default)
                text = f"{item.metadata['doc']} (default {default})"
                lines.extend(textwrap.wrap(text, 98, initial_indent="# ", subsequent_indent="# "))
            line = f"{item.name} = {_toml_value(getattr(values, item.name))}"
            if (section.name, item.name) == ("batching", "attention_weight"):
                line += _resolved_attention_weight(config)
            lines.append(line)
    return "\n".join(lines) + "\n"


EXAMPLE_HEADER = """\
# rlfeed sidecar configuration: every field with its meaning, unit and default.
# Use: rlfeed serve --config rlfeed.example.toml   (flags --host/--port override [server])
# Unknown keys are an error. Generated from rlfeed.service.config (example_config_text);
# tests/service/config/test_config.py keeps this file in sync with the dataclasses.
"""


def example_config_text() -> str:
    """The documented default config: the content of deploy/rlfeed.example.toml."""
    return EXAMPLE_HEADER + "\n" + dump_config(SidecarConfig(), "toml", with_docs=True)
