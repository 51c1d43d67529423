// Thread-pool engine behind aio.h. Workers block in pread/pwrite: with O_DIRECT each call hands the
// drive one large request, so `threads * queue_depth` workers keep that many requests in flight —
// what libaio or io_uring would do with a ring, without depending on either being available.
#include "aio.h"

#include <linux/io_uring.h>
#include <semaphore.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

struct zo_aio_req {
    std::atomic<int64_t> pending{0};
    std::atomic<bool> finished{false};
    std::atomic<bool> failed{false};  // later chunks of a failed request are skipped
    std::mutex m;
    std::condition_variable cv;
    int status = 0;
    int64_t err_offset = -1;
    uint32_t expected = 0, actual = 0;
};

namespace {

struct Chunk {
    zo_aio_req* req;
    int op;
    int fd;
    int64_t offset;
    char* buf;
    int64_t len;
    uint32_t* sum;
};

struct Failure {
    int status = 0;
    int64_t offset = -1;
    uint32_t expected = 0, actual = 0;
};

// Loops because a regular file may legally transfer less than asked (signals, size limits).
Failure transfer(const Chunk& c) {
    int64_t done = 0;
    while (done < c.len) {
        ssize_t r = c.op == ZO_AIO_READ ? pread(c.fd, c.buf + done, c.len - done, c.offset + done)
                                        : pwrite(c.fd, c.buf + done, c.len - done, c.offset + done);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return {errno, c.offset + done};
        if (r == 0) return {c.op == ZO_AIO_READ ? ZO_AIO_ESHORT : ENOSPC, c.offset + done};
        done += r;
    }
    return {};
}

Failure run_chunk(const Chunk& c) {
    if (c.op == ZO_AIO_WRITE && c.sum) *c.sum = zo_checksum(c.buf, c.len);
    Failure f = transfer(c);
    if (f.status == 0 && c.op == ZO_AIO_READ && c.sum) {
        uint32_t got = zo_checksum(c.buf, c.len);
        if (got != *c.sum) f = {ZO_AIO_ECHECKSUM, c.offset, *c.sum, got};
    }
    return f;
}

void finish_chunk(zo_aio_req* req, const Failure& f) {
    if (f.status != 0) {
        std::lock_guard<std::mutex> lk(req->m);
        if (req->status == 0) {
            req->status = f.status;
            req->err_offset = f.offset;
            req->expected = f.expected;
            req->actual = f.actual;
        }
        req->failed.store(true);
    }
    if (req->pending.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lk(req->m);
        req->finished.store(true);
        req->cv.notify_all();
    }
}

}  // namespace

// Workers sleep on a counting semaphore posted once per queued chunk (and once per worker at
// shutdown), so a request of n chunks wakes exactly n workers. A condition variable would need
// notify_all (every idle worker wakes to fight over the lock, and on a small machine the
// submitting thread loses its core to them) or notify_one, which glibc's condition variable can
// lose (sourceware bug 25847), leaving a chunk queued until the next submit. POSIX semaphores are
// a plain futex counter: no wake-up is lost.
struct zo_aio_engine {
    std::mutex m;
    sem_t ready;
    std::deque<Chunk> queue;
    std::vector<std::thread> workers;

    zo_aio_engine() { sem_init(&ready, 0, 0); }
    ~zo_aio_engine() { sem_destroy(&ready); }

    // A worker wakes once per post; every post before shutdown follows a push, so it finds a
    // chunk. After shutdown's posts a worker that finds the queue empty is done.
    void work() {
        for (;;) {
            while (sem_wait(&ready) != 0) {
            }  // EINTR: wait again
            Chunk c;
            {
                std::lock_guard<std::mutex> lk(m);
                if (queue.empty()) return;  // a shutdown post, nothing left to do
                c = queue.front();
                queue.pop_front();
            }
            finish_chunk(c.req, c.req->failed.load() ? Failure{} : run_chunk(c));
        }
    }
};

extern "C" zo_aio_engine* zo_aio_create(int threads, int queue_depth) {
    // Compared without multiplying: threads * queue_depth may overflow int and start no worker.
    if (threads < 1 || queue_depth < 1 || threads > 4096 / queue_depth) return nullptr;
    auto* eng = new zo_aio_engine();
    for (int i = 0; i < threads * queue_depth; ++i) eng->workers.emplace_back([eng] { eng->work(); });
    return eng;
}

extern "C" void zo_aio_destroy(zo_aio_engine* eng) {
    if (!eng) return;
    for (size_t i = 0; i < eng->workers.size(); ++i) sem_post(&eng->ready);  // queued chunks first
    for (auto& t : eng->workers) t.join();
    delete eng;
}

extern "C" int zo_aio_workers(const zo_aio_engine* eng) {
    return eng ? static_cast<int>(eng->workers.size()) : 0;
}

extern "C" zo_aio_req* zo_aio_submit(zo_aio_engine* eng, int op, int fd, int64_t offset, void* buf,
                                     int64_t len, int64_t chunk, uint32_t* sums) {
    if (!eng || !buf || len <= 0 || offset < 0 || (op != ZO_AIO_READ && op != ZO_AIO_WRITE))
        return nullptr;
    if (chunk <= 0) chunk = len;
    int64_t n = (len + chunk - 1) / chunk;
    auto* req = new zo_aio_req();
    req->pending.store(n);
    {
        std::lock_guard<std::mutex> lk(eng->m);
        for (int64_t i = 0; i < n; ++i) {
            int64_t off = i * chunk;
            int64_t piece = len - off < chunk ? len - off : chunk;
            eng->queue.push_back(Chunk{req, op, fd, offset + off, static_cast<char*>(buf) + off, piece,
                                       sums ? sums + i : nullptr});
        }
    }
    for (int64_t i = 0; i < n; ++i) sem_post(&eng->ready);  // wakes n workers, no more
    return req;
}

extern "C" int zo_aio_wait(zo_aio_req* req) {
    std::unique_lock<std::mutex> lk(req->m);
    req->cv.wait(lk, [&] { return req->finished.load(); });
    return req->status;
}

extern "C" int zo_aio_done(const zo_aio_req* req) { return req->finished.load() ? 1 : 0; }

extern "C" int zo_aio_error(const zo_aio_req* req, int64_t* offset, uint32_t* expected,
                            uint32_t* actual) {
    if (offset) *offset = req->err_offset;
    if (expected) *expected = req->expected;
    if (actual) *actual = req->actual;
    return req->status;
}

extern "C" void zo_aio_free(zo_aio_req* req) { delete req; }

extern "C" int zo_aio_uring_available(void) {
    io_uring_params p{};
    long fd = syscall(__NR_io_uring_setup, 4, &p);
    if (fd < 0) return 0;
    close(static_cast<int>(fd));
    return 1;
}
