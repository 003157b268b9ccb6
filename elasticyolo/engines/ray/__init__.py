"""`engine=ray`: elastic YOLO training on a Ray cluster (docs/ray-engine.md).

`submit`, `status` and `cancel` (`job.py`) are the Python entry, for a Ray driver; the CLI is
`elasticyolo ray submit|status|cancel`. Torch-free at import; Ray is imported on first use.
"""

from __future__ import annotations

from typing import Any


def submit(*args: Any, **kwargs: Any) -> dict[str, Any]:
    from elasticyolo.engines.ray.job import submit as run

    return run(*args, **kwargs)


def status(*args: Any, **kwargs: Any) -> dict[str, Any]:
    from elasticyolo.engines.ray.job import status as run

    return run(*args, **kwargs)


def cancel(*args: Any, **kwargs: Any) -> bool:
    from elasticyolo.engines.ray.job import cancel as run

    return run(*args, **kwargs)


__all__ = ["cancel", "status", "submit"]
