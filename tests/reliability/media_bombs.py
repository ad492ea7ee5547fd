"""Hostile media made in a few bytes (headers declaring huge sizes, absurd rates, MP4s whose
frames repeat one empty P-frame) and the peak memory of a process tree, for the tests that
check such input is refused before it costs memory."""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import soundfile
from PIL import Image


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def peak_rss(root: int) -> dict[int, int]:
    """Peak RSS in bytes of each process of the tree (VmHWM: never goes down)."""
    peaks = {}
    for pid in process_tree(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks[pid] = int(line.split()[1]) * 1024
    return peaks


def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG header for width x height RGB over one compressed row: a few hundred bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = zlib.compress(b"\x00" * (1 + width * 3), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", row) + chunk(b"IEND", b"")


def webp_declaring(width: int, height: int) -> bytes:
    """A lossless WebP of one colour, its header rewritten to width x height (~44 bytes):
    every pixel of a one-colour VP8L image decodes from zero bits, so it stays valid."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 20, 30)).save(buf, "WEBP", lossless=True)
    data = bytearray(buf.getvalue())
    assert data[12:16] == b"VP8L"
    bits = int.from_bytes(data[21:25], "little") & ~((1 << 28) - 1)
    data[21:25] = (bits | (width - 1) | ((height - 1) << 14)).to_bytes(4, "little")
    return bytes(data)


def wav(rate: int, samples: int) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(samples, dtype=np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def flac_silence(rate: int, seconds: int) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(rate * seconds, dtype=np.int16), rate, format="FLAC")
    return buf.getvalue()


def repeated_mp4(height: int, width: int, n: int, fps: int) -> bytes:
    """A fragmented H.264 MP4 (no frame count or duration in its header) of `n` black frames,
    encoded once: frame 0's keyframe, then frame 1's empty P-frame muxed n - 1 times."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4", options={"movflags": "frag_keyframe+empty_moov"}) as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast"})
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        coded = []
        for i in range(2):
            black.pts = i
            coded += [bytes(p) for p in stream.encode(black)]
        coded += [bytes(p) for p in stream.encode()]
        for i in range(n):
            packet = av.Packet(coded[min(i, 1)])
            packet.stream, packet.pts, packet.dts = stream, i, i
            packet.time_base, packet.is_keyframe = Fraction(1, fps), i == 0
            container.mux(packet)
    return out.getvalue()
