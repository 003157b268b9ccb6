"""The uploader's reused in-memory spool behaves as a file, also when a smaller checkpoint
follows a bigger one in the same memory."""

from __future__ import annotations

import io
import shutil

from elasticyolo.checkpoint.spool import MemorySpool


def test_reused_spool_reads_back_only_what_was_written_since_reset() -> None:
    spool = MemorySpool()
    big = bytes(range(256)) * 1000
    spool.write(big[:100])
    spool.write(memoryview(big)[100:])
    assert spool.tell() == len(big)
    spool.seek(0)
    assert spool.read() == big

    small = b"checkpoint two"
    spool.reset().write(small)  # overwrites the start of the same memory
    assert spool.seek(0, io.SEEK_END) == len(small) and spool.getbuffer() == small
    spool.seek(0)
    assert spool.read(5) == b"check" and spool.read(100) == b"point two" and spool.read(1) == b""
    spool.seek(3)
    into = bytearray(4)
    assert spool.readinto(into) == 4 and into == b"ckpo"
    spool.seek(0)
    out = io.BytesIO()
    shutil.copyfileobj(spool, out, 4)
    assert out.getvalue() == small
