"""Generate a small detection dataset in Ultralytics format that a real model can learn.

Each class is a distinct (shape, colour) pair drawn on a noisy background, so mAP rises quickly
with training. Deterministic for a given seed. Uses PIL and numpy only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw

SHAPES = ("square", "circle", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 220), "yellow": (230, 210, 40)}
# Class i differs from its neighbours in both shape and colour; 12 unique pairs (lcm of 3 and 4).
CLASS_TABLE = [(SHAPES[i % len(SHAPES)], list(COLOURS)[i % len(COLOURS)]) for i in range(12)]


@dataclass(frozen=True)
class SynthSpec:
    train: int = 64
    val: int = 16
    imgsz: int = 128
    classes: int = 3
    max_objects: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.classes <= len(CLASS_TABLE):
            raise ValueError(f"classes must be between 1 and {len(CLASS_TABLE)}, got {self.classes}")
        if self.imgsz < 32:
            raise ValueError(f"imgsz must be at least 32, got {self.imgsz}")
        if self.train < 1 or self.val < 1:
            raise ValueError("train and val must be at least 1 image each")


def class_names(k: int) -> dict[int, str]:
    return {i: f"{CLASS_TABLE[i][1]}-{CLASS_TABLE[i][0]}" for i in range(k)}


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "circle":
        draw.ellipse(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)


def _image(rng: random.Random, nrng: np.random.Generator, spec: SynthSpec) -> tuple[Image.Image, list[str]]:
    s = spec.imgsz
    background = nrng.integers(90, 150, size=(s, s, 3), dtype=np.uint8)
    background = (background + nrng.normal(0, 12, size=(s, s, 3))).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(background)
    draw = ImageDraw.Draw(img)
    labels: list[str] = []
    placed: list[tuple[int, int, int, int]] = []
    for _ in range(rng.randint(1, spec.max_objects)):
        for _attempt in range(20):  # avoid heavy overlap so every box is visible
            side = rng.randint(max(8, s // 6), max(10, s // 3))
            x0, y0 = rng.randint(0, s - side), rng.randint(0, s - side)
            box = (x0, y0, x0 + side, y0 + side)
            if all(box[2] <= p[0] or box[0] >= p[2] or box[3] <= p[1] or box[1] >= p[3] for p in placed):
                break
        else:
            continue
        placed.append(box)
        cls = rng.randrange(spec.classes)
        shape, colour = CLASS_TABLE[cls]
        _draw(draw, shape, box, COLOURS[colour])
        cx, cy = (box[0] + box[2]) / 2 / s, (box[1] + box[3]) / 2 / s
        labels.append(f"{cls} {cx:.6f} {cy:.6f} {side / s:.6f} {side / s:.6f}")
    return img, labels


def write_dataset(out: Path, spec: SynthSpec) -> Path:
    """Write images/, labels/ and data.yaml under `out`; returns the data.yaml path."""
    out = out.resolve()
    rng = random.Random(spec.seed)
    nrng = np.random.default_rng(spec.seed)
    for split, count in (("train", spec.train), ("val", spec.val)):
        img_dir, lbl_dir = out / "images" / split, out / "labels" / split
        img_dir.mkdir(parents=True, exist_ok=True)
        lbl_dir.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            img, labels = _image(rng, nrng, spec)
            img.save(img_dir / f"{split}_{i:05d}.png")
            (lbl_dir / f"{split}_{i:05d}.txt").write_text("\n".join(labels) + ("\n" if labels else ""))
    data_yaml = out / "data.yaml"
    data_yaml.write_text(
        yaml.safe_dump(
            {"path": str(out), "train": "images/train", "val": "images/val", "names": class_names(spec.classes)},
            sort_keys=False,
        )
    )
    return data_yaml
