"""Progress reporting sinks: a terminal progress bar and a JSON-lines file."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO


class ProgressBar:
    """A progress bar over the whole run (epochs x samples), only on a terminal: Ultralytics' own
    TQDM (the `tqdm` package is not a dependency of Ultralytics 8.4, nor ours)."""

    def __init__(self, total_epochs: int, num_samples: int, stream: TextIO | None = None) -> None:
        from ultralytics.utils import TQDM

        self.stream = stream or sys.stderr
        self.num_samples = num_samples
        # disable=False: Ultralytics hides its bars when its logger is quiet, as ours is.
        self.bar = TQDM(total=total_epochs * num_samples, unit="img", file=self.stream, disable=False)

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") != "step":
            return
        done = rec["epoch"] * self.num_samples + rec["consumed"]
        self.bar.update(max(done - self.bar.n, 0))
        desc = f"epoch {min(rec['epoch'] + 1, rec['epochs'])}/{rec['epochs']} loss {rec['loss']:.3f} lr {rec['lr']:.2e}"
        if rec.get("metrics"):
            desc += f" mAP50-95 {rec['metrics']['mAP50-95']:.3f}"
        self.bar.set_description(desc)

    def close(self) -> None:
        self.bar.close()


class JsonLines:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, rec: dict[str, Any]) -> None:
        self.stream.write(json.dumps(rec) + "\n")
        self.stream.flush()
