"""Shared-memory tensor transport: pooled segments in /dev/shm, zero-copy on the reading side.

A producer copies a CPU tensor once into a segment from its own pool and sends a small
`ShmRef` instead of the bytes. Each segment is a file `/dev/shm/<prefix>-<pid>-<n>` with a
64-byte header: byte 0 = number of readers, bytes 1..63 = one "released" flag per reader
slot. A reader maps the segment (mappings are cached), wraps the bytes in a tensor without
copying, and sets its slot's flag when that tensor's storage dies. The producer reuses a
segment once every reader slot is released, so steady state allocates nothing.

Reader slots: a value sent on an output port goes to each of the port's out-edges; edge i
reads with slot i (the router releases the slots of edges it does not deliver to).
A worker unlinks its segments when it exits; the orchestrator unlinks a dead worker's once
no request that was in flight when it died remains, and releases the slots a dead reader held
(`SegmentPool.force_release`, checked against the segment's use count); `cleanup_prefix`
removes whatever is left when the pipeline closes.
Small CPU tensors travel inline as raw bytes (InlineTensor). CUDA tensors are pickled by the
producer with torch's multiprocessing reductions (a CUDA IPC handle, no copy) into an opaque
CudaTensorRef that the router forwards untouched and the consumer opens.
Messages themselves are pickled with the standard pickler (runtime.messages.send_msg), never
with multiprocessing's ForkingPickler, which would move CPU tensors into torch's fd-passing
shared memory.
"""

from __future__ import annotations

import glob
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SHM_DIR = "/dev/shm"
HEADER = 64
MAX_READERS = HEADER - 1
INLINE_MAX_BYTES = 32 * 1024  # smaller tensors are pickled inline
_MIN_SEGMENT = 64 * 1024


@dataclass(frozen=True)
class ShmRef:
    """A CPU tensor living in a shared segment."""

    segment: str  # file name under SHM_DIR
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    use: int = 0  # the segment's use count when written (see SegmentPool.force_release)


@dataclass(frozen=True)
class InlineTensor:
    """A small CPU tensor as raw bytes."""

    data: bytes
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> InlineTensor:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(raw, t.dtype, tuple(t.shape))

    def tensor(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(self.dtype).reshape(self.shape)


@dataclass(frozen=True)
class CudaTensorRef:
    """A CUDA tensor pickled by its producer with torch's reductions (CUDA IPC handle), once
    per reader slot so each reader's open is reference-counted on its own."""

    blobs: tuple[bytes, ...]

    @classmethod
    def of(cls, t: torch.Tensor, nreaders: int) -> CudaTensorRef:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers the CUDA IPC reductions

        t = t.detach()
        return cls(tuple(bytes(ForkingPickler.dumps(t)) for _ in range(max(1, nreaders))))

    def tensor(self, slot: int = 0) -> torch.Tensor:
        import pickle

        import torch.multiprocessing  # noqa: F401

        return pickle.loads(self.blobs[slot])


class _Segment:
    __slots__ = ("name", "size", "mm", "nreaders", "use")

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.nreaders = 0
        self.use = 0

    def is_free(self) -> bool:
        n = self.nreaders
        return n == 0 or self.mm[1 : 1 + n] == b"\x01" * n


def worker_pool_prefix(pipeline_prefix: str, stage: str, replica: int, generation: int) -> str:
    """The pool prefix of one generation of one stage replica's worker."""
    return f"{pipeline_prefix}-{stage}{replica}g{generation}"


def segment_prefix(pool_prefix: str, pid: int) -> str:
    """What every segment file of the pool `pool_prefix` in process `pid` is named before
    its `-<n>`: the pid keeps a restarted or forked process from reusing a dead one's names."""
    return f"{pool_prefix}-{pid}"


class SegmentPool:
    """A producer's segments, grouped by power-of-two size class."""

    def __init__(self, prefix: str):
        self.prefix = segment_prefix(prefix, os.getpid())
        self._classes: dict[int, list[_Segment]] = {}
        self._by_name: dict[str, _Segment] = {}
        self._count = 0
        self._lock = threading.Lock()

    def _acquire(self, nbytes: int, nreaders: int) -> _Segment:
        size = max(_MIN_SEGMENT, 1 << (nbytes + HEADER - 1).bit_length())
        with self._lock:
            segments = self._classes.setdefault(size, [])
            for seg in segments:
                if seg.is_free():
                    break
            else:
                self._count += 1
                seg = _Segment(f"{self.prefix}-{self._count}", size)
                segments.append(seg)
                self._by_name[seg.name] = seg
            seg.mm[0:HEADER] = bytes([nreaders]) + b"\x00" * (HEADER - 1)
            seg.nreaders = nreaders
            seg.use += 1
            return seg

    def put(self, tensor: torch.Tensor, nreaders: int) -> ShmRef:
        if not 1 <= nreaders <= MAX_READERS:
            raise ValueError(f"a shared tensor supports 1..{MAX_READERS} readers, not {nreaders}")
        nbytes = tensor.numel() * tensor.element_size()
        seg = self._acquire(nbytes, nreaders)
        if nbytes:
            dst = torch.frombuffer(seg.mm, dtype=torch.uint8, count=nbytes, offset=HEADER)
            dst.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return ShmRef(seg.name, nbytes, tensor.dtype, tuple(tensor.shape), seg.use)

    def force_release(self, name: str, use: int, slot: int) -> bool:
        """Release a reader slot on behalf of a reader that died holding it. Only while the
        segment is still in the use the slot was handed out for: reuse happens under the
        same lock, so a slot of a later use is never touched."""
        with self._lock:
            seg = self._by_name.get(name)
            if seg is None or seg.use != use or not 0 <= slot < seg.nreaders:
                return False
            seg.mm[1 + slot] = 1
            return True

    def num_segments(self) -> int:
        return len(self._by_name)

    def close(self, unlink: bool = False) -> None:
        with self._lock:
            for segments in self._classes.values():
                for seg in segments:
                    if unlink:
                        try:
                            os.unlink(os.path.join(SHM_DIR, seg.name))
                        except FileNotFoundError:
                            pass
                    try:
                        seg.mm.close()
                    except BufferError:
                        pass  # a live view still uses it; the mapping dies with the process
            self._classes.clear()
            self._by_name.clear()


class SegmentReader:
    """A reader's cache of mapped segments; turns ShmRefs into zero-copy tensors."""

    def __init__(self):
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _map(self, name: str) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is None:
            with self._lock:
                mm = self._maps.get(name)
                if mm is None:
                    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
                    try:
                        mm = mmap.mmap(fd, os.fstat(fd).st_size)
                    finally:
                        os.close(fd)
                    self._maps[name] = mm
        return mm

    def tensor(self, ref: ShmRef, slot: int, copy: bool = False) -> torch.Tensor:
        mm = self._map(ref.segment)
        if copy or ref.nbytes == 0:
            out = torch.empty(ref.shape, dtype=ref.dtype)
            if ref.nbytes:
                src = torch.frombuffer(mm, dtype=torch.uint8, count=ref.nbytes, offset=HEADER)
                out.view(torch.uint8).view(-1).copy_(src)
            self.release(ref, slot)
            return out
        arr = np.frombuffer(mm, dtype=np.uint8, count=ref.nbytes, offset=HEADER)
        # The slot is released when the last tensor viewing these bytes is freed.
        weakref.finalize(arr, _release, mm, slot)
        return torch.from_numpy(arr).view(ref.dtype).view(ref.shape)

    def release(self, ref: ShmRef, slot: int) -> None:
        _release(self._map(ref.segment), slot)

    def forget(self, prefix: str) -> None:
        """Drop cached mappings of segments whose files were unlinked (a dead producer's);
        a mapping still viewed by a live tensor is unmapped when the last view dies."""
        with self._lock:
            for name in [n for n in self._maps if n.startswith(prefix)]:
                del self._maps[name]

    def close(self) -> None:
        with self._lock:
            for mm in self._maps.values():
                try:
                    mm.close()
                except BufferError:
                    pass
            self._maps.clear()


def _release(mm: mmap.mmap, slot: int) -> None:
    try:
        mm[1 + slot] = 1
    except (ValueError, IndexError):
        pass  # mapping already closed (process shutting down)


# -- walking message payloads -------------------------------------------------------------
_SCALARS = frozenset((int, float, str, bool, type(None)))


def _plain_scalars(values: list | tuple) -> bool:
    return set(map(type, values)) <= _SCALARS


def encode(value: Any, pool: SegmentPool, nreaders: int) -> Any:
    """Replace large CPU tensors (at any depth of dicts/lists/tuples) by ShmRefs."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cuda":
            return CudaTensorRef.of(value, nreaders)
        if value.device.type != "cpu":
            value = value.cpu()
        if value.numel() * value.element_size() > INLINE_MAX_BYTES:
            return pool.put(value.detach(), nreaders)
        return InlineTensor.of(value)
    if isinstance(value, dict):
        return {k: encode(v, pool, nreaders) for k, v in value.items()}
    if isinstance(value, list):
        if _plain_scalars(value):  # token ids: copied whole, not encoded element by element
            return list(value)
        return [encode(v, pool, nreaders) for v in value]
    if isinstance(value, tuple):
        return tuple(encode(v, pool, nreaders) for v in value)
    return value


def decode(value: Any, reader: SegmentReader, slot: int, copy: bool = False) -> Any:
    if isinstance(value, ShmRef):
        return reader.tensor(value, slot, copy=copy)
    if isinstance(value, InlineTensor):
        return value.tensor()
    if isinstance(value, CudaTensorRef):
        return value.tensor(slot)
    if isinstance(value, dict):
        return {k: decode(v, reader, slot, copy) for k, v in value.items()}
    if isinstance(value, list):
        if _plain_scalars(value):
            return list(value)
        return [decode(v, reader, slot, copy) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v, reader, slot, copy) for v in value)
    return value


def release_all(value: Any, reader: SegmentReader, slot: int) -> None:
    """Release `slot` of every ShmRef in a payload that will not be delivered."""
    if isinstance(value, ShmRef):
        try:
            reader.release(value, slot)
        except FileNotFoundError:
            pass
    elif isinstance(value, dict):
        for v in value.values():
            release_all(v, reader, slot)
    elif isinstance(value, (list, tuple)) and not _plain_scalars(value):
        for v in value:
            release_all(v, reader, slot)


def iter_refs(value: Any):
    """Every ShmRef in a payload, at any depth."""
    if isinstance(value, ShmRef):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_refs(v)
    elif isinstance(value, (list, tuple)) and not _plain_scalars(value):  # token ids: one check, not one generator each
        for v in value:
            yield from iter_refs(v)


def has_refs(value: Any) -> bool:
    if isinstance(value, ShmRef):
        return True
    if isinstance(value, dict):
        return any(has_refs(v) for v in value.values())
    if isinstance(value, (list, tuple)) and not _plain_scalars(value):
        return any(has_refs(v) for v in value)
    return False


def cleanup_prefix(prefix: str) -> int:
    """Unlink every segment file of a pipeline; returns how many were removed."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "-*")):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def owner_pid(name: str) -> int | None:
    """The pid of the process that created a pipeline, from one of its segment names
    (`omnistage-<pid>-<id>-...`); None for a name of another scheme."""
    parts = name.split("-")
    if len(parts) < 3 or parts[0] != "omnistage" or not parts[1].isdigit():
        return None
    return int(parts[1])


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting for its parent's wait() counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] in "ZX"


def reap_orphan_segments() -> list[str]:
    """Unlink this user's segment files whose pipeline owner has exited: what a group killed
    at once (SIGKILL, an OOM kill of the parent) left behind. A pid reused by a live process
    keeps its files (never a live pipeline's); another user's files are left alone."""
    reaped = []
    uid = os.getuid()
    gone: dict[int, bool] = {}
    for name in os.listdir(SHM_DIR):
        pid = owner_pid(name)
        if pid is None:
            continue
        if pid not in gone:
            gone[pid] = process_gone(pid)
        if not gone[pid]:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid == uid:
                os.unlink(path)
                reaped.append(name)
        except FileNotFoundError:
            pass
    return reaped
