"""Process checks the tests share: the product's own (elasticyolo/processes.py)."""

from __future__ import annotations

from elasticyolo.processes import running

__all__ = ["running"]
