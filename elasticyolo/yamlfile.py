"""A YAML file that must hold a mapping, read with one-line errors (what and where)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elasticyolo.errors import UserError


def read_yaml_mapping(path: Path, label: str, expected: str) -> dict[Any, Any]:
    """The mapping in `path`. Errors read `{label}: file not found`, `{label}: cannot read it: ...`
    or `{label}: expected {expected}` (an empty file is no mapping either)."""
    import yaml  # lazily: the CLI's quick paths never read YAML

    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{label}: file not found") from None
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{label}: cannot read it: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{label}: expected {expected}")
    return data
