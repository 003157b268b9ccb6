"""The real spot trace the chaos tests replay: the shared copy when the checkout sits next to
`shared/traces/`, else the copy kept in tests/data/ (same bytes; see tests/data/README.md)."""

from __future__ import annotations

from pathlib import Path

TRACE_NAME = "shared/traces/aws-p3-32node-parcae.csv"
REAL_TRACE = next((p / TRACE_NAME for p in Path(__file__).resolve().parents if (p / TRACE_NAME).exists()),
                  Path(__file__).with_name("data") / "aws-p3-32node-parcae.csv")
