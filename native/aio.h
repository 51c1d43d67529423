// Asynchronous file I/O for the NVMe tier: requests of (fd, offset, buffer, length) split into
// chunks that worker threads serve with pread/pwrite, so no system library (libaio, liburing) is
// needed. Each chunk can carry a block checksum (checksum.h): computed before a write, verified
// after a read, on the worker thread, so the caller's thread (and Python's GIL) never pays for it.
//
// Lifetime: zo_aio_submit returns a request the caller must pass to zo_aio_free after zo_aio_wait
// (or after zo_aio_done returned 1). The buffer and the checksum array must stay alive until then.
#pragma once
#include <cstdint>

#include "checksum.h"

#define ZO_AIO_READ 0
#define ZO_AIO_WRITE 1

// Request status: 0 success, > 0 an errno from the OS, or one of these.
#define ZO_AIO_ECHECKSUM (-1)  // data read back does not match the checksum written with it
#define ZO_AIO_ESHORT (-2)     // end of file before `len` bytes were read

typedef struct zo_aio_engine zo_aio_engine;
typedef struct zo_aio_req zo_aio_req;

extern "C" {
// `threads * queue_depth` requests' chunks are in flight at once (one blocking syscall per worker).
zo_aio_engine* zo_aio_create(int threads, int queue_depth);
// Finishes every queued chunk, then joins the workers.
void zo_aio_destroy(zo_aio_engine* eng);
// Worker threads started: threads * queue_depth (0 for NULL).
int zo_aio_workers(const zo_aio_engine* eng);

// Splits [offset, offset+len) into `chunk`-byte pieces (the last may be shorter); sums, when not
// NULL, holds one checksum per piece: filled by a write, checked by a read. NULL on bad arguments.
zo_aio_req* zo_aio_submit(zo_aio_engine* eng, int op, int fd, int64_t offset, void* buf,
                          int64_t len, int64_t chunk, uint32_t* sums);
// Blocks until every chunk finished; returns the request status (first failure wins).
int zo_aio_wait(zo_aio_req* req);
// 1 when finished, else 0; never blocks.
int zo_aio_done(const zo_aio_req* req);
// Details of the first failure: file offset where it happened, and for ZO_AIO_ECHECKSUM the
// checksum expected and the one found. Returns the status.
int zo_aio_error(const zo_aio_req* req, int64_t* offset, uint32_t* expected, uint32_t* actual);
void zo_aio_free(zo_aio_req* req);

// 1 when the kernel accepts io_uring_setup (probed with the raw syscall), else 0.
int zo_aio_uring_available(void);
}
