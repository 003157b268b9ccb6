#!/usr/bin/env bash
# bench/throughput.py's GPU figures in one call to a lent GPU machine, which has python3 with
# torch but none of our other packages and no registry (see the workplace's device README).
#
#   here, with PyPI:     bench/gpu_check.sh wheels        # .whl/: the packages the machine lacks (4.5 MB)
#   there, in one call:  bench/gpu_check.sh run [IMAGES]  # carry: [".whl"]; output under $OUT (or /tmp/gpu-check)
#
# `run` installs the wheels into /tmp/site, generates IMAGES (default 512) images at 640 px once,
# in parallel, and runs the throughput bench twice (yolov8n, imgsz 640, batch 16, workers 8,
# 4 epochs, the first warm-up): with `--cache ram` and with no cache, both against Ultralytics'
# trainer with the same setting, and elasticyolo with and without CUDA graphs (`--eager-too`); the
# second run also profiles 8 steps each way (GPU busy share, kernel launches per micro-batch).
# Each run is time-boxed; the summary lines are printed last. A smoke test here, on the CPU:
#   INSTALL=0 PY=.venv/bin/python DEVICE=cpu IMGSZ=64 bench/gpu_check.sh run 32
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(ultralytics==8.4.190 ultralytics-thop==2.2.3 pydantic==2.14.4 pydantic-core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 structlog==26.1.0 tenacity==9.2.1)

case "${1:-}" in
wheels)
    rm -rf .whl && mkdir -p .whl
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    ;;
run)
    images=${2:-512} py=${PY:-python3} device=${DEVICE:-0} imgsz=${IMGSZ:-640}
    out=${OUT:-/tmp/gpu-check}
    mkdir -p "$out"
    [ "${INSTALL:-1}" = 0 ] || "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "gpu_check: installing .whl/ failed (run 'bench/gpu_check.sh wheels' here first)"; exit 2; }
    export PYTHONPATH="/tmp/site:$PWD"
    [ "$device" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
    rm -rf /tmp/gpu-check-data
    "$py" - "$images" "$imgsz" /tmp/gpu-check-data <<'EOF' || exit 2
import os, shutil, sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from elasticyolo.data.synth import SynthSpec, write_dataset

images, imgsz, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
parts = min(8, os.cpu_count() or 1)

def part(i: int) -> Path:
    n = images // parts + (i < images % parts)
    return write_dataset(root / f"part{i}", SynthSpec(train=n, val=2, imgsz=imgsz, classes=3, seed=i)).parent

with ProcessPoolExecutor(parts) as pool:
    done = list(pool.map(part, range(parts)))
for i, d in enumerate(done):  # one dataset: every part's files, renamed apart
    for kind in ("images", "labels"):
        for split in ("train", "val"):
            dest = root / kind / split
            dest.mkdir(parents=True, exist_ok=True)
            for f in (d / kind / split).iterdir():
                shutil.move(str(f), dest / f"p{i}_{f.name}")
    shutil.copy(d / "data.yaml", root / "data.yaml") if i == 0 else None
    shutil.rmtree(d)
text = (root / "data.yaml").read_text().replace(str(done[0]), str(root))
(root / "data.yaml").write_text(text)
print(f"gpu_check: {images} images at {imgsz} px in {root}")
EOF
    for cache in ram false; do
        profile=$([ "$cache" = false ] && echo 8 || echo 0)  # once: where a step's time goes, graphs and eager
        timeout 300 "$py" bench/throughput.py --device "$device" --imgsz "$imgsz" --data /tmp/gpu-check-data/data.yaml \
            --epochs 4 --cache "$cache" --eager-too --skip-baselines --profile "$profile" > "$out/throughput-$cache.txt" 2>&1
        echo "== cache=$cache (rc $?) =="
        grep -E "^(throughput|elasticyolo|Ultralytics YOLO|profile)" "$out/throughput-$cache.txt" \
            || tail -20 "$out/throughput-$cache.txt"
    done
    ;;
*)
    echo "usage: bench/gpu_check.sh wheels | run [IMAGES]" >&2
    exit 2
    ;;
esac
