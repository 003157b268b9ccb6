"""The uploader's spool behaves as a file: reused from one checkpoint to the next, and keeping
references (not copies) to bytes that lie in the registered slot buffers."""

from __future__ import annotations

import io
import shutil

from elasticyolo.checkpoint.spool import SegmentSpool


def test_reused_spool_reads_back_only_what_was_written_since_reset() -> None:
    spool = SegmentSpool()
    big = bytes(range(256)) * 1000
    spool.write(big[:100])
    spool.write(memoryview(big)[100:])
    assert spool.tell() == len(big)
    spool.seek(0)
    assert spool.read() == big

    small = b"checkpoint two"
    spool.reset().write(small)  # overwrites the start of the same memory
    assert spool.seek(0, io.SEEK_END) == len(small) and b"".join(spool.views()) == small
    spool.seek(0)
    assert spool.read(5) == b"check" and spool.read(100) == b"point two" and spool.read(1) == b""
    spool.seek(3)
    into = bytearray(4)
    assert spool.readinto(into) == 4 and into == b"ckpo"
    spool.seek(0)
    out = io.BytesIO()
    shutil.copyfileobj(spool, out, 4)
    assert out.getvalue() == small


def test_writes_inside_the_slot_are_kept_as_references_in_file_order() -> None:
    slot = bytearray(bytes(range(256)) * 2048)  # 512 KB, the "shared-memory slot"
    view = memoryview(slot)
    spool = SegmentSpool(min_reference=1024).reset([view])
    header, tensor_a, footer, tensor_b = b"HDR", view[1000:201000], b"--", view[300000:500000]
    for piece in (header, tensor_a, footer, tensor_b, b"END"):
        spool.write(piece)
    expected = header + bytes(tensor_a) + footer + bytes(tensor_b) + b"END"
    assert spool.tell() == len(expected)
    spool.seek(0)
    assert bytes(spool.read()) == expected

    slot[1000] = (slot[1000] + 1) % 256  # the spool refers to the slot: it reads the change
    spool.seek(3)
    assert spool.read(1)[0] == slot[1000]

    # Reads inside one piece are views, reads across pieces are joined; sizes always as asked.
    spool.seek(0)
    got = bytearray()
    while chunk := spool.read(8192):
        assert len(chunk) == min(8192, len(expected) - len(got))
        got += chunk
    assert bytes(got) == bytes(header + bytes(view[1000:201000]) + footer + bytes(tensor_b) + b"END")
    assert b"".join(spool.views()) == bytes(got)

    # A reader's view of the arena does not stop the next checkpoint from growing it.
    held = spool.reset().write(b"x") and next(spool.views())
    spool.reset().write(bytes(1 << 20))
    assert bytes(held) == b"x" and sum(len(v) for v in spool.views()) == 1 << 20

    # Bytes from elsewhere, and small slot bytes, are copied.
    spool.reset([view]).write(view[0:10])
    spool.write(bytes(100_000))
    slot[0] = (slot[0] + 1) % 256
    spool.seek(0)
    assert spool.read(1)[0] != slot[0]
