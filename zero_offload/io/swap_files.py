"""The swap store's files on disk: checked paths, one preallocated file per path, its manifest.

Layout: `<path>/zero_offload-<name>-rank<rank>/` (0700) holds `swap.bin` (0600) and
`manifest.json`, which names the owning process. A directory left by a crashed run (its owner is
dead) is reused when the manifest matches what is asked now, and removed otherwise, with a
message either way; one whose owner still runs is refused. The manifest's pid can only be looked
up in this host's (this container's) process table, so the owner also holds an exclusive flock
on swap.bin for the store's life: a process on another host sharing the path (NFS) or in another
container on the same disk is refused too, instead of taking over or removing live files.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
from typing import Sequence

import psutil

from zero_offload.io.buffers import round_up

log = logging.getLogger("zero_offload.io")
MANIFEST_FORMAT = 1
_warned_buffered: set[int] = set()  # st_dev of filesystems already reported as lacking O_DIRECT


class SwapError(OSError):
    """A swap-store fault: bad path, not enough space, checksum mismatch, failed I/O."""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_paths(paths: Sequence[str]) -> list[str]:
    """Absolute paths, each an existing directory; the first that is not is a one-line error."""
    if not paths:
        raise SwapError(errno.EINVAL, "swap store needs at least one nvme path")
    out = []
    for p in paths:
        ap = os.path.abspath(os.path.expanduser(p))
        if not os.path.exists(ap):
            raise SwapError(errno.ENOENT, f"nvme path {p!r} does not exist")
        if not os.path.isdir(ap):
            raise SwapError(errno.ENOTDIR, f"nvme path {p!r} is not a directory")
        out.append(ap)
    if len(set(out)) != len(out):
        raise SwapError(errno.EINVAL, f"nvme paths {list(paths)} name the same directory twice")
    return out


def check_space(needs: dict[str, int]) -> None:
    """Free space per filesystem against the bytes the files there will take (path -> bytes)."""
    by_dev: dict[int, list[str]] = {}
    for p in needs:
        by_dev.setdefault(os.stat(p).st_dev, []).append(p)
    for group in by_dev.values():
        need = sum(needs[p] for p in group)
        free = psutil.disk_usage(group[0]).free
        if need > free:
            where = ", ".join(group)
            raise SwapError(errno.ENOSPC, f"not enough free space on {where}: swap store needs {need} bytes "
                                          f"({_gib(need)}), only {free} bytes ({_gib(free)}) free")


def _owner_alive(manifest: dict) -> bool:
    """Whether the process that wrote the manifest still runs (same pid AND same start time)."""
    pid = manifest.get("pid")
    try:
        return isinstance(pid, int) and abs(psutil.Process(pid).create_time() - manifest.get("pid_start", -1)) < 0.01
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _read_manifest(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


class SwapFile:
    """One preallocated swap file and its directory; `remove()` deletes both.

    Built in two steps so that the store can check free space between them: the constructor only
    settles a leftover directory (reuse, remove or refuse); `create()` makes and allocates the file.
    """

    def __init__(self, root: str, name: str, rank: int) -> None:
        self.dir = os.path.join(root, f"zero_offload-{name}-rank{rank}")
        self.path = os.path.join(self.dir, "swap.bin")
        self.manifest_path = os.path.join(self.dir, "manifest.json")
        self.name, self.rank, self.fd, self.direct, self.size = name, rank, -1, False, 0
        self.reused = self._take_leftover()
        # Whether the directory is ours to delete: made here, or a crashed run's taken over.
        # remove() after a failed create() must not touch (nor warn about) a directory that was
        # never made: on a read-only filesystem rmdir answers EROFS, not ENOENT, for a missing one.
        self.owns_dir = self.reused
        self.existing_bytes = os.stat(self.path).st_size if self.reused else 0

    def create(self, size: int, *, direct: bool) -> None:
        """Make (or take over) the file, allocate `size` bytes and write the manifest."""
        if not self.reused:
            self._create_dir()
        self.direct = direct
        self._open(self.reused)
        self.grow(size)
        self.write_manifest()

    def _take_leftover(self) -> bool:
        """Reuse or remove a directory a crashed run left; refuse one whose owner is alive."""
        if not os.path.lexists(self.dir):
            return False
        old = _read_manifest(self.manifest_path)
        if old is not None and _owner_alive(old):
            who = (f"another engine of this process (pid {old['pid']}): close() it first" if old["pid"] == os.getpid()
                   else f"running process {old['pid']}")
            raise SwapError(errno.EBUSY, f"swap dir {self.dir} is in use by {who}")
        if _locked(self.path):
            raise SwapError(errno.EBUSY, f"swap dir {self.dir} is in use by a process that holds its lock (pid "
                                         f"{(old or {}).get('pid')} in its manifest is not running here: another "
                                         "host or container?)")
        why = self._mismatch(old)
        if why is None:
            log.warning("reusing swap file %s left by a crashed run (pid %s)", self.path, old["pid"])
            return True
        log.warning("removing swap dir %s left by a crashed run: %s", self.dir, why)
        shutil.rmtree(self.dir) if os.path.isdir(self.dir) and not os.path.islink(self.dir) else os.unlink(self.dir)
        return False

    def _mismatch(self, old: dict | None) -> str | None:
        """Why the leftover cannot be reused, or None when it can."""
        if old is None:
            return "no readable manifest"
        if (old.get("format"), old.get("name"), old.get("rank")) != (MANIFEST_FORMAT, self.name, self.rank):
            return "manifest is for another store"
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return "swap file missing"
        if not os.path.isfile(self.path) or st.st_size != old.get("size"):
            return "swap file does not match its manifest"
        return None

    def _create_dir(self) -> None:
        try:
            os.mkdir(self.dir, 0o700)
            self.owns_dir = True
            os.chmod(self.dir, 0o700)  # mkdir's mode is filtered by the umask
        except OSError as exc:
            raise SwapError(exc.errno, f"nvme path {os.path.dirname(self.dir)!r} is not writable: "
                                       f"cannot create {self.dir}: {exc.strerror}") from None

    def _open(self, reused: bool) -> None:
        flags = os.O_RDWR | (0 if reused else os.O_CREAT | os.O_EXCL)
        try:
            fd = os.open(self.path, flags, 0o600)
            try:
                os.fchmod(fd, 0o600)
            except BaseException:
                os.close(fd)  # not yet in self.fd, so remove() would never close it
                raise
        except OSError as exc:
            raise SwapError(exc.errno, f"cannot create swap file {self.path}: {exc.strerror}") from None
        self.fd = fd
        if self.direct:
            self._reopen_direct()
        self._lock()

    def _lock(self) -> None:
        """An exclusive flock on the final fd, held until remove() closes it (see the module doc)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.warning("%s: no file locks here (%s): only the manifest's pid guards it", self.path, exc.strerror)
                return
            self.owns_dir = False  # another process took it over first: its files, not ours to remove
            raise SwapError(errno.EBUSY, f"swap file {self.path} is locked by another process") from None

    def _reopen_direct(self) -> None:
        """Swap the fd for an O_DIRECT one; a filesystem that refuses it keeps buffered I/O."""
        try:
            fd = open_direct(self.path)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise SwapError(exc.errno, f"cannot open swap file {self.path}: {exc.strerror}") from None
            self.direct = False
            dev = os.fstat(self.fd).st_dev
            if dev not in _warned_buffered:
                _warned_buffered.add(dev)
                log.warning("%s does not support O_DIRECT (tmpfs?): swap files there use buffered I/O", self.dir)
            return
        os.close(self.fd)
        self.fd = fd

    def grow(self, size: int) -> None:
        """Allocate the file's blocks up to `size` now, so no write can later meet a full disk."""
        size = max(round_up(size), os.fstat(self.fd).st_size)
        try:
            if size:  # fallocate refuses a zero length
                os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            raise SwapError(exc.errno, f"cannot allocate {size} bytes for {self.path}: {exc.strerror}") from None
        self.size = size

    def write_manifest(self) -> None:
        me = psutil.Process()
        data = {"format": MANIFEST_FORMAT, "name": self.name, "rank": self.rank, "pid": me.pid,
                "pid_start": me.create_time(), "size": self.size}
        tmp = self.manifest_path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.manifest_path)

    def remove(self) -> None:
        """Close the file; delete it, its manifest and the directory (if nothing else is in it)
        when the directory is ours (owns_dir), else there is nothing of ours on disk to delete."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.owns_dir:
            return
        for p in (self.path, self.manifest_path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("swap dir %s not removed: %s", self.dir, exc.strerror)


def _locked(path: str) -> bool:
    """Whether another open file holds the exclusive flock on `path` (see SwapFile._lock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below
        return False
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)


def open_direct(path: str) -> int:
    """O_DIRECT fd on `path`; a module-level seam so tests can play a filesystem without it."""
    return os.open(path, os.O_RDWR | os.O_DIRECT)
