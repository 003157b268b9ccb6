"""The spot providers the agent knows: the one list that flags, config and the factory check.

No imports: `--spot-provider` choices and the agent config validate against it cheaply.
"""

from __future__ import annotations

# Cloud metadata APIs with a notice watcher (spot/aws.py, gcp.py, azure.py).
CLOUDS = ("aws", "gcp", "azure")
# `none`: no cloud watcher (a notice file and signals still work); `auto`: probe the metadata address.
PROVIDERS = (*CLOUDS, "none", "auto")


def check_provider(name: str | None) -> str:
    """The provider name in canonical (lower) case; ValueError naming the choices otherwise."""
    value = (name or "none").lower()
    if value not in PROVIDERS:
        raise ValueError(f"{name!r}: expected one of {', '.join(PROVIDERS)}")
    return value
