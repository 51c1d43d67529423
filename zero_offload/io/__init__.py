"""The NVMe tier's bytes: async I/O backends (aio), aligned host buffers (buffers), the swap store (swap)."""
