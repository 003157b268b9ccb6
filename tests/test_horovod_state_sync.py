"""A reset's state transfer (train/state_shares.send_shards over Horovod, engines/horovod/state_sync.py) in a real 3-rank Horovod job
(Gloo, loopback): the ranks that differ from rank 0 end with its values bit for bit, whatever
the dtypes, shapes and layout, and the ranks that hold them already are left as they were."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elasticyolo.train.state_shares import shard_bounds

SCRIPT = textwrap.dedent("""
    import sys
    import horovod.torch as hvd
    import torch
    from elasticyolo.engines.horovod.state_sync import send_shards

    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return [
            torch.randn(7, 5, generator=g).t(),                  # not contiguous
            torch.tensor(seed * 1000 + 7, dtype=torch.int64),    # 0-dim, 8-byte elements
            torch.randn(3, generator=g) > 0,                     # bool
            torch.randn(9, generator=g).half(),                  # 2-byte elements, odd count
            torch.randn(100_003, generator=g, dtype=torch.float64),
            torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
            torch.randn(0),                                      # empty
        ]

    hvd.init()
    senders, receivers = [int(r) for r in sys.argv[1].split(",")], [int(r) for r in sys.argv[2].split(",")]
    rank = hvd.rank()
    mine = state(0 if rank in senders else rank + 1)  # the senders hold rank 0's values
    send_shards(mine, senders, receivers)
    expected = state(0)
    for i, (t, e) in enumerate(zip(mine, expected)):
        assert t.dtype == e.dtype and t.shape == e.shape, (rank, i)
        assert torch.equal(t, e), f"rank {rank}: tensor {i} differs"
    print("ok", rank, flush=True)
""")


@pytest.mark.parametrize("senders,receivers", [("0,1", "2"), ("0", "1,2"), ("0,2", "1")])
def test_receivers_end_with_rank_0s_state(tmp_path: Path, senders: str, receivers: str) -> None:
    script = tmp_path / "sync.py"
    script.write_text(SCRIPT)
    horovodrun = Path(sys.executable).with_name("horovodrun")
    proc = subprocess.run([str(horovodrun), "--gloo", "-np", "3", "-H", "localhost:3", "--network-interface", "lo",
                           sys.executable, str(script), senders, receivers],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert sorted(line.split("ok ")[1][0] for line in out.splitlines() if "ok " in line) == ["0", "1", "2"], out[-3000:]


@pytest.mark.parametrize("total,senders", [(0, 1), (5, 3), (1000, 1), (1000, 3), (38_000_016, 2), (48, 7)])
def test_shards_cover_the_state_in_order_at_aligned_cuts(total: int, senders: int) -> None:
    bounds = shard_bounds(total, senders)
    assert len(bounds) == senders
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(lo <= hi for lo, hi in bounds)
    assert all(lo % 16 == 0 for lo, _ in bounds)
    if total >= 16 * senders * 16:
        sizes = [hi - lo for lo, hi in bounds]
        assert max(sizes) - min(sizes) <= 2 * 16  # the work is shared evenly (cuts round down to 16)
