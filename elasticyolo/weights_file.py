"""Is a file a PyTorch checkpoint? A cheap check by its first bytes, without torch (the agent and
the CLI never import it), for weights a job names (`model=`, `pretrained=`)."""

from __future__ import annotations

from pathlib import Path

from elasticyolo.errors import UserError

# How a file written by `torch.save` starts: a zip archive (torch >= 1.6), or a pickle (legacy format).
_CHECKPOINT_MAGIC = (b"PK\x03\x04", b"\x80\x02")


def check_weights_file(path: Path, where: str, error: type[UserError] = UserError) -> None:
    """Cheap check, without torch, that `path` is a file `torch.save` wrote; `error` otherwise."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise error(f"{where}: cannot read it ({exc.strerror})") from None
    if not head.startswith(_CHECKPOINT_MAGIC):
        what = "an empty file" if not head else "not a PyTorch checkpoint"
        raise error(f"{where}: {what} (expected a .pt written by torch.save, such as an Ultralytics or "
                    "elasticyolo last.pt or best.pt)")
