"""The swap store's files on disk: checked paths, one preallocated file per path, its manifest.

Layout: `<path>/zero_offload-<name>-rank<rank>/` (0700) holds `swap.bin` (0600) and
`manifest.json`, which names the owning process. A directory left by a crashed run (its owner is
dead) is reused when the manifest matches what is asked now, and removed otherwise, with a
message either way; one whose owner still runs is refused. The manifest's pid can only be looked
up in this host's (this container's) process table, so the owner also holds an exclusive flock
on swap.bin for the store's life: a process on another host sharing the path (NFS) or in another
container on the same disk is refused too, instead of taking over or removing live files.
Within this process, only an open store holds its directory (`_LIVE`): one a closed store could
not delete (`_LEFT`, `FilesLeft`) is taken over like a crashed run's. While files are held,
SIGTERM with its default action deletes them before it ends the process (`_SigtermGuard`;
docs/faults.md).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import threading
from typing import Any, Sequence

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


def _owner_alive(manifest: dict[str, Any]) -> bool:
    """Whether the process that wrote the manifest still runs (same pid AND same start time)."""
    pid = manifest.get("pid")
    try:
        return isinstance(pid, int) and abs(psutil.Process(pid).create_time() - manifest.get("pid_start", -1)) < 0.01
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _read_manifest(path: str) -> dict[str, Any] | None:
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
        if old is not None and _owner_alive(old) and not _closed_here(self.dir, old):
            who = (f"another engine of this process (pid {old['pid']}): close() it first" if old["pid"] == os.getpid()
                   else f"running process {old['pid']}")
            raise SwapError(errno.EBUSY, f"swap dir {self.dir} is in use by {who}")
        if _locked(self.path):
            raise SwapError(errno.EBUSY, f"swap dir {self.dir} is in use by a process that holds its lock (pid "
                                         f"{(old or {}).get('pid')} in its manifest is not running here: another "
                                         "host or container?)")
        left = _LEFT.pop(self.dir, None)
        if left is not None:  # a closed store of this process could not remove it: now it is ours
            left.owns_dir = False
        origin = "a closed engine of this process" if left is not None else "a crashed run"
        why = self._mismatch(old)
        if why is None:
            log.warning("reusing swap file %s left by %s (pid %s)", self.path, origin, (old or {}).get("pid"))
            return True
        log.warning("removing swap dir %s left by %s: %s", self.dir, origin, why)
        shutil.rmtree(self.dir) if os.path.isdir(self.dir) and not os.path.islink(self.dir) else os.unlink(self.dir)
        return False

    def _mismatch(self, old: dict[str, Any] | None) -> str | None:
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
        _LIVE[self.dir] = self  # before anything below can fail: remove() forgets it
        if self.direct:
            self._reopen_direct()
        self._lock()
        _sigterm_guard.arm()

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
        """Close the file, releasing the path (its lock, and this process's claim on it) however
        the rest ends; then delete the file, its manifest and the directory (if nothing else is
        in it) when the directory is ours (owns_dir), else there is nothing of ours on disk to
        delete. A file that cannot be deleted stays listed (`_LEFT`), and `FilesLeft` names it:
        calling remove() again tries again; a new store on the path may take it over meanwhile."""
        try:
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)
        finally:
            if _LIVE.get(self.dir) is self:
                del _LIVE[self.dir]
                _sigterm_guard.disarm_if_idle()
        if not self.owns_dir:
            return
        failed = [f"{p} ({exc.strerror})" for p in (self.path, self.manifest_path) if (exc := _unlink(p)) is not None]
        if failed:
            _LEFT[self.dir] = self
            raise FilesLeft(failed)
        _LEFT.pop(self.dir, None)
        self.owns_dir = False  # removed: a later remove() has nothing to do
        try:
            os.rmdir(self.dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("swap dir %s not removed: %s", self.dir, exc.strerror)


class FilesLeft(SwapError):
    """Swap files close() could not delete: they remain on disk (the message names each one).
    Calling close() again tries again."""

    def __init__(self, failed: list[str]) -> None:
        super().__init__(errno.EIO, f"could not remove swap file(s) {', '.join(failed)}: they remain on disk; "
                                    "make their folder writable and call close() again to remove them")
        self.failed = failed


def _unlink(path: str) -> OSError | None:
    """None when `path` is gone (or never was), else why it could not be deleted."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc
    return None


def remove_files(files: Sequence[SwapFile]) -> None:
    """Try every file (one failure does not keep the others on disk), then one FilesLeft for all."""
    failed: list[str] = []
    for f in files:
        try:
            f.remove()
        except FilesLeft as exc:
            failed += exc.failed
    if failed:
        raise FilesLeft(failed)


def remove_left(roots: Sequence[str]) -> None:
    """Retry the files closed stores of this process could not delete under `roots` (nvme paths)."""
    where = {os.path.abspath(os.path.expanduser(r)) for r in roots}
    remove_files([f for d, f in list(_LEFT.items()) if os.path.dirname(d) in where])


def _closed_here(directory: str, manifest: dict[str, Any]) -> bool:
    """A directory whose manifest names this process but that no open store of it holds: left by
    a store that was closed (its files could not be removed), so as free as a crashed run's."""
    return manifest.get("pid") == os.getpid() and directory not in _LIVE


# This process's swap directories: held by an open store; and closed but not yet deleted.
_LIVE: dict[str, SwapFile] = {}
_LEFT: dict[str, SwapFile] = {}


class _SigtermGuard:
    """SIGTERM's default action ends the process at once, atexit handlers and finalizers unrun,
    and would leave every preallocated swap file on disk. While this process holds swap files,
    and only where SIGTERM still has its default action (a handler someone installed is left in
    place: it decides), this handler deletes them and then ends the process by the same signal,
    as the default would have. Python runs it on the main thread between two bytecodes, where
    that thread may hold any lock: it takes none and logs nothing. I/O still in flight on other
    threads goes to files already unlinked, which the kernel frees when the process ends."""

    def __init__(self) -> None:
        self.installed = False

    def arm(self) -> None:
        if self.installed or threading.current_thread() is not threading.main_thread():
            return  # signal.signal works on the main thread only; elsewhere SIGTERM stays as it is
        current = signal.getsignal(signal.SIGTERM)
        if current == self.handle:
            self.installed = True
        elif current is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self.handle)
            self.installed = True

    def disarm_if_idle(self) -> None:
        """Give SIGTERM its default back once no swap file is held (if nobody replaced ours)."""
        if not self.installed or _LIVE or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self.handle:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.installed = False

    def handle(self, signum: int, frame: Any) -> None:
        remove_now()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def remove_now() -> None:
    """Delete every swap file this process holds or left, ignoring failures: the process is
    about to end (see _SigtermGuard)."""
    for f in list(_LIVE.values()) + list(_LEFT.values()):
        if f.owns_dir:
            for p in (f.path, f.manifest_path):
                _unlink(p)
            try:
                os.rmdir(f.dir)
            except OSError:
                pass


_sigterm_guard = _SigtermGuard()


def is_sigterm_guard(handler: Any) -> bool:
    """Whether `handler` is the swap files' SIGTERM handler (the default action, files removed first)."""
    return bool(handler == _sigterm_guard.handle)


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
