"""`--set section.field=value` overrides, type-checked against the dataclass fields."""

from __future__ import annotations

import dataclasses
import difflib
import typing

from configs.base import ConfigError, RunConfig


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def all_keys(cfg: RunConfig) -> list[str]:
    """Every settable dotted key, e.g. 'model.n_layers'."""
    keys = []
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(value)]
    return keys


def _convert(key: str, text: str, kind: type) -> object:
    try:
        if kind is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        if kind is int:
            return int(text.replace("_", ""))
        if kind is float:
            return float(text)
        return text
    except ValueError:
        raise ConfigError(
            f"--set {key}={text}: expected a value of type {kind.__name__}"
            + (" (true or false)" if kind is bool else "")
        ) from None


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Return `cfg` with each 'section.field=value' applied in order."""
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.field=value, e.g. --set train.lr=3e-4")
        if key not in all_keys(cfg):
            close = difflib.get_close_matches(key, all_keys(cfg), n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else "; see the printed config for all keys"
            raise ConfigError(f"--set {key}: no such config key{hint}")
        section_name, field_name = key.split(".", 1)
        section = getattr(cfg, section_name)
        kind = typing.get_type_hints(type(section))[field_name]
        section = dataclasses.replace(section, **{field_name: _convert(key, text.strip(), kind)})
        cfg = dataclasses.replace(cfg, **{section_name: section})
    return cfg
