"""Dataset staging from S3: elasticyolo's stager vs what a user would script instead.

Against the local S3 server (moto on 127.0.0.1), one generated dataset, side by side in one run:
  * elasticyolo cold: `Stager.stage()` into an empty cache (parallel, verified, journaled);
  * elasticyolo warm: the same dataset again (a second job on the node: listing + stat only);
  * naive loop: `boto3 client.download_file` object after object (a plain script);
  * raw transfer manager: boto3's TransferManager at the same concurrency, no verification,
    no journal (what our verification and resumability cost on top).
Prints seconds and ratios (median of --repeat runs).

    .venv/bin/python bench/staging.py [--images 1000] [--imgsz 160] [--concurrency 16] [--repeat 3]

moto is a single Python process on the same 2 cores, so absolute rates are far below real S3's;
the ratios show the shape (per-object latency hidden by concurrency), not S3's speed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import boto3  # noqa: E402

from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.local_cluster.servers import S3Server  # noqa: E402
from elasticyolo.staging.cache import DatasetCache  # noqa: E402
from elasticyolo.staging.stager import Stager, s3_client  # noqa: E402
from elasticyolo.staging.upload import upload_dataset  # noqa: E402


def naive(bucket: str, prefix: str, dest: Path) -> None:
    s3 = boto3.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            target = dest / item["Key"][len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, item["Key"], str(target))


def raw_transfer_manager(bucket: str, prefix: str, dest: Path, concurrency: int) -> None:
    from s3transfer.manager import TransferConfig, TransferManager

    client = s3_client({}, concurrency)
    tm = TransferManager(client, TransferConfig(max_request_concurrency=concurrency))
    futures = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            target = dest / item["Key"][len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            futures.append(tm.download(bucket, item["Key"], str(target)))
    for f in futures:
        f.result()
    tm.shutdown()


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--imgsz", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-staging-"))
    try:
        ds = write_dataset(work / "shapes", SynthSpec(train=args.images, val=max(1, args.images // 10),
                                                      imgsz=args.imgsz)).parent
        files = [p for p in ds.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        with S3Server() as srv:
            os.environ.update(srv.env())
            boto3.client("s3").create_bucket(Bucket="bench")
            upload_dataset(ds, "s3://bench/shapes", {})
            uri = "s3://bench/shapes/data.yaml"
            n = [0]

            def cold() -> None:
                n[0] += 1
                Stager(DatasetCache(work / f"cache{n[0]}"), max_concurrency=args.concurrency).stage(uri)

            t_cold = timed(cold, args.repeat)
            warm_cache = DatasetCache(work / "cache1")
            t_warm = timed(lambda: Stager(warm_cache, max_concurrency=args.concurrency).stage(uri), args.repeat)

            def run_naive() -> None:
                n[0] += 1
                naive("bench", "shapes/", work / f"naive{n[0]}")

            t_naive = timed(run_naive, args.repeat)

            def run_raw() -> None:
                n[0] += 1
                raw_transfer_manager("bench", "shapes/", work / f"raw{n[0]}", args.concurrency)

            t_raw = timed(run_raw, args.repeat)
        mb = size / 1e6
        print(f"dataset: {len(files)} files, {mb:.1f} MB; concurrency {args.concurrency}; median of {args.repeat}")
        print(f"  elasticyolo cold stage     {t_cold:7.2f} s  ({mb / t_cold:6.1f} MB/s)")
        print(f"  elasticyolo warm (reuse)   {t_warm:7.2f} s")
        print(f"  naive boto3 loop           {t_naive:7.2f} s  ({mb / t_naive:6.1f} MB/s)")
        print(f"  raw TransferManager        {t_raw:7.2f} s  ({mb / t_raw:6.1f} MB/s)")
        print(f"ratios: naive/cold {t_naive / t_cold:.2f}x, cold/raw {t_cold / t_raw:.2f}x "
              f"(the listing gives size and ETag: no HEAD per object, unlike the plain transfer manager), cold/warm {t_cold / t_warm:.1f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
