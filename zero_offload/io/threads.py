"""`DaemonPool`: worker threads for blocking I/O calls that keep working while the interpreter exits.

concurrent.futures' ThreadPoolExecutor stops every pool when the interpreter starts to shut
down (before atexit handlers and weakref finalizers run): its workers quit and `submit` raises
"cannot schedule new futures after (interpreter) shutdown". An engine dropped without close() is
closed by a finalizer at exit, and a stage-3 prefetch may still be reading then, so the pools the
swap store's I/O goes through must outlive that moment; they stop only when their owner closes
them. The threads are daemons, so a pool nobody closed never blocks the exit.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable


class DaemonPool(concurrent.futures.Executor):
    """Up to `workers` daemon threads, started as requests arrive; `shutdown` joins them."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"DaemonPool needs at least one worker, got {workers}")
        self._max, self._name = workers, name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # released by each worker that waits for work
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} thread pool is shut down")
            fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._queue.put((fut, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
        return fut

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args, kwargs = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # the waiting side sees it, as from ThreadPoolExecutor
                    fut.set_exception(exc)
            del item, fut
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Run what was submitted, then stop the threads; idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._queue.put(None)
        if wait:
            for t in list(self._threads):
                if t is not threading.current_thread():
                    t.join()
