/* hicache_store.backends._fileio: batches of file reads and writes with the GIL released.
 *
 * ``read_files(items)`` reads each item's file (one open, vectored reads from that fd, one
 * close) into the item's buffers, all without the GIL: the file backend's pool thread then
 * needs the interpreter once per batch instead of once per system call. In a process whose
 * other threads keep the interpreter busy (an inference engine's scheduler), every GIL
 * reacquisition waits up to the switch interval, and a read of one object took five of them.
 *
 * An item is ``(path: str, buffers: list of writable buffers, start: int, length: int,
 * direct: bool[, spans])``: ``length`` -1 reads the whole object (it must fit the buffers),
 * else the range ``[start, start + length)`` (it must lie within the object). ``spans``, a
 * sequence of ``(offset, length)`` pairs, each inside one buffer (offsets count from the
 * first buffer's start, through the buffers in order), asks for the xxh3_64 of those bytes
 * once they are read, computed in the same GIL-free run (``bind_xxh3`` must have named the
 * hash first): a reader verifies a batch of checksummed objects without taking the GIL back
 * per object. The bytes fill the
 * buffers in order; nothing past them, nor past the bytes read, is written. ``direct``: read
 * with O_DIRECT when the range, every buffer address and every buffer length but the last are
 * 4096-aligned, the length is a multiple of 4096 and ``cachestat`` does not report the whole
 * range cached (bytes in the page cache are read buffered; an unknown answer reads direct).
 *
 * Per item the result is ``(status, value, size, flags, sums)``:
 *   status 0: read; ``value`` bytes (the length). ``flags``: bit 0 read with O_DIRECT, bit 1
 *             the range was not known to be cached (a cold read), bit 2 the range and
 *             buffers were aligned for O_DIRECT.
 *   status 1: a system call failed; ``value`` is its errno (ENOENT: no such object).
 *   status 2: not a regular file.
 *   status 3: the object (``size`` bytes) does not fit the buffers, or the range is outside it.
 *   status 4: the file ended early; ``value`` bytes were read.
 * ``size`` is the object's stored size where it was known (else -1). ``sums`` holds the
 * xxh3_64 of each span, in order, when the read succeeded (status 0) and read every span's
 * bytes; else it is empty. The caller maps each status to its own errors and compares the
 * sums with what it expects (``backends.file``, ``objects.io``); this module decides nothing
 * else.
 *
 * ``write_files(items)`` writes a batch of objects the file backend's way, all without the
 * GIL: per item ``(tmp: str, final: str, buffer, direct: bool, flush: int)``, a new file
 * ``tmp`` (``O_EXCL``, mode 0644; ``direct``: ``O_DIRECT`` for the 4096-aligned body, the
 * tail as one zero-padded block, then truncated), flushed (``flush`` 1: ``fdatasync``, 2:
 * ``fsync``), closed, then renamed onto ``final``; where ``final``'s directory is missing, it
 * and its missing ancestors are made first (mode 0777 less the umask; ``flush`` 2: each
 * new directory's entry ``fsync``-ed in its parent). Per item
 * the result is ``(status, errno)``: 0 published; 1 a system call failed (``errno``) and the
 * temp file is removed. Every item is attempted whatever the others did.
 *
 * ``start_write_files(items, start_by)`` is ``write_files`` on the module's writer threads
 * (POSIX threads, kept, that never take the GIL; a job's items side by side, one key's
 * writes in the order they were started), begun only if ``CLOCK_MONOTONIC`` (Python's
 * ``time.monotonic``) has not passed ``start_by`` when its first item is taken (else
 * nothing of it is written): it returns a
 * ``WriteJob`` at once; ``job.done()`` tells, without waiting, whether the writes have ended;
 * ``job.wait()`` waits for them (GIL released) and returns ``(outcomes, began, ended)``: per
 * item ``(status, errno)`` as ``write_files``' (status 2: not attempted, the job began late),
 * and the monotonic seconds at which the writes began and ended (None when never begun). For
 * a caller whose thread keeps the GIL busy (an engine's scheduler loop): no Python thread has
 * to win the GIL before the writes start or after they end. The job holds the buffers until
 * its writes have ended: one dropped before that waits for them first.
 *
 * ``start_read_files(items)`` is ``read_files`` on a thread of its own (a POSIX thread that never
 * takes the GIL): it returns a ``ReadJob`` at once; ``job.done()`` tells, without waiting or
 * releasing the GIL, whether every read has ended; ``job.wait()`` waits for them (GIL
 * released) and returns what ``read_files`` would have. For a caller that polls from a thread
 * already holding the GIL (an engine's scheduler loop): the reads need no Python thread, so no
 * GIL hand-off stands between them and the poll that finds them done. The job holds the
 * buffers until its reads have ended: one dropped before that waits for them first.
 *
 * ``bind_xxh3(path)`` takes ``XXH3_64bits`` from the already loaded shared object ``path``
 * (the ``xxhash`` package's extension, whose hash every checksum of the library is): the
 * same code computes the sums here and in Python, so they cannot disagree.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define ALIGN 4096
#define MAX_IOV 1024
#define MAX_IO 0x7ffff000L
#ifndef SYS_cachestat
#define SYS_cachestat 451
#endif

struct cs_range { uint64_t off, len; };
struct cs_stat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };

static int cachestat_works = 1; /* cleared at the first refusal (old kernel, sandbox) */

typedef unsigned long long (*xxh3_fn)(const void *, size_t);
static xxh3_fn xxh3_64 = NULL; /* set by bind_xxh3 */

typedef struct {
    const char *at;      /* inside one buffer */
    long long offset;    /* from the first buffer's start */
    long long length;
} span_t;

typedef struct {
    PyObject *path;      /* bytes (filesystem encoding) */
    Py_buffer *bufs;
    Py_ssize_t nbufs;
    long long start;
    long long length;    /* -1: the whole object */
    int direct;
    span_t *spans;
    Py_ssize_t nspans;
    /* results */
    int status;
    long long value;
    long long size;
    int flags;
    unsigned long long *sums; /* nspans of them when summed */
    int summed;
} item_t;

/* 1: every page of [off, off + len) is cached; 0: some is not, or the system cannot tell. */
static int fully_cached(int fd, long long off, long long len) {
    if (!cachestat_works || len <= 0) return 0;
    struct cs_range r = {(uint64_t)off, (uint64_t)len};
    struct cs_stat s;
    memset(&s, 0, sizeof s);
    if (syscall(SYS_cachestat, fd, &r, &s, 0) != 0) {
        cachestat_works = 0;
        return 0;
    }
    long page = sysconf(_SC_PAGESIZE);
    uint64_t first = (uint64_t)off / page;
    uint64_t pages = ((uint64_t)off + len + page - 1) / page - first;
    return s.nr_cache >= pages;
}

/* Read ``total`` bytes at ``off`` into the iovecs (consumed as they fill). */
static int read_all(int fd, struct iovec *iov, int n, long long off, long long total,
                    long long *done) {
    *done = 0;
    while (*done < total) {
        while (n > 0 && iov[0].iov_len == 0) { iov++; n--; }
        /* at most MAX_IO per call (the kernel's cap): trim the iovec list to it */
        int k = 0;
        long long chunk = 0;
        while (k < n && k < MAX_IOV && chunk < MAX_IO) { chunk += iov[k].iov_len; k++; }
        size_t saved = 0;
        if (chunk > MAX_IO) {
            saved = iov[k - 1].iov_len;
            iov[k - 1].iov_len -= (size_t)(chunk - MAX_IO);
        }
        ssize_t got = preadv(fd, iov, k, off + *done);
        if (saved) iov[k - 1].iov_len = saved;
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (got == 0) return -1; /* the file ended early */
        *done += got;
        long long left = got;
        while (left > 0 && n > 0) {
            if ((long long)iov[0].iov_len <= left) {
                left -= iov[0].iov_len;
                iov[0].iov_len = 0;
                iov++;
                n--;
            } else {
                iov[0].iov_base = (char *)iov[0].iov_base + left;
                iov[0].iov_len -= (size_t)left;
                left = 0;
            }
        }
    }
    return 0;
}

static void read_item(item_t *it) {
    it->size = -1;
    it->flags = 0;
    int fd = open(PyBytes_AS_STRING(it->path), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) { it->status = 1; it->value = errno; return; }
    struct stat st;
    if (fstat(fd, &st) != 0) { it->status = 1; it->value = errno; close(fd); return; }
    if (!S_ISREG(st.st_mode)) { it->status = 2; it->value = 0; close(fd); return; }
    it->size = st.st_size;
    long long capacity = 0;
    for (Py_ssize_t i = 0; i < it->nbufs; i++) capacity += it->bufs[i].len;
    long long start = it->start, length = it->length;
    if (length < 0) {
        start = 0;
        length = st.st_size;
        if (length > capacity) { it->status = 3; it->value = 0; close(fd); return; }
    } else if (start < 0 || start + length > st.st_size || length > capacity) {
        it->status = 3; it->value = 0; close(fd); return;
    }
    /* the leading ``length`` bytes of the buffers, as iovecs */
    struct iovec iov[MAX_IOV];
    int n = 0;
    long long left = length;
    int aligned = start % ALIGN == 0 && length % ALIGN == 0;
    for (Py_ssize_t i = 0; i < it->nbufs && left > 0; i++) {
        long long take = it->bufs[i].len < left ? it->bufs[i].len : left;
        if (take == 0) continue;
        iov[n].iov_base = it->bufs[i].buf;
        iov[n].iov_len = (size_t)take;
        if ((uintptr_t)iov[n].iov_base % ALIGN || take % ALIGN) aligned = 0;
        n++;
        left -= take;
    }
    int cold = !fully_cached(fd, start, length);
    if (cold) it->flags |= 2;
    if (aligned) it->flags |= 4;
    if (it->direct && aligned && cold) {
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0 && fcntl(fd, F_SETFL, fl | O_DIRECT) == 0) it->flags |= 1;
    }
    long long done = 0;
    int rc = length ? read_all(fd, iov, n, start, length, &done) : 0;
    close(fd);
    if (rc > 0) { it->status = 1; it->value = rc; return; }
    if (rc < 0) { it->status = 4; it->value = done; return; }
    it->status = 0;
    it->value = length;
    for (Py_ssize_t i = 0; i < it->nspans; i++)
        if (it->spans[i].offset + it->spans[i].length > length) return; /* not all read */
    for (Py_ssize_t i = 0; i < it->nspans; i++)
        it->sums[i] = xxh3_64(it->spans[i].at, (size_t)it->spans[i].length);
    it->summed = 1;
}

static void release_items(item_t *items, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(items[i].path);
        if (items[i].bufs) {
            for (Py_ssize_t b = 0; b < items[i].nbufs; b++) PyBuffer_Release(&items[i].bufs[b]);
            PyMem_Free(items[i].bufs);
        }
        PyMem_Free(items[i].spans);
        PyMem_Free(items[i].sums);
    }
    PyMem_Free(items);
}

typedef struct {
    PyObject *tmp, *final; /* bytes (filesystem encoding) */
    Py_buffer buf;
    int has_buf, direct, flush;
    int status, err;
} witem_t;

static int pwrite_all(int fd, const char *p, long long n, long long off) {
    while (n > 0) {
        ssize_t got = pwrite(fd, p, (size_t)(n < MAX_IO ? n : MAX_IO), off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        p += got; n -= got; off += got;
    }
    return 0;
}

/* ``path`` less its last component into ``dir`` (PATH_MAX bytes); 0 where there is none to
 * copy ("/x", a relative name, a path too long). */
static int parent_of(const char *path, char *dir) {
    const char *slash = strrchr(path, '/');
    size_t n = slash ? (size_t)(slash - path) : 0;
    if (n == 0 || n >= PATH_MAX) return 0;
    memcpy(dir, path, n);
    dir[n] = '\0';
    return 1;
}

/* fsync the directory that holds ``path``'s last component; 0 or errno. */
static int fsync_parent(const char *path) {
    char dir[PATH_MAX];
    if (!parent_of(path, dir)) return 0; /* nothing to do here */
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    int rc = fsync(fd) != 0 ? errno : 0;
    close(fd);
    return rc;
}

/* Make ``dir`` and whichever of its ancestors are missing (``os.makedirs``); 0 or errno.
 * Each new directory's entry is made durable in its parent (``durable``) before anything is
 * published in it. Made here, on the writer thread, rather than by the caller: a new
 * shard's ``mkdir`` calls run without the GIL instead of as a Python ``makedirs`` on the
 * engine's thread. */
static int make_dirs(char *dir, int durable, int depth) {
    if (mkdir(dir, 0777) == 0) return durable ? fsync_parent(dir) : 0;
    if (errno == EEXIST) return 0;
    if (errno != ENOENT || depth >= 32) return errno;
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) return ENOENT;
    *slash = '\0'; /* the parent first, */
    int rc = make_dirs(dir, durable, depth + 1);
    *slash = '/';   /* then ``dir`` again */
    if (rc) return rc;
    if (mkdir(dir, 0777) == 0) return durable ? fsync_parent(dir) : 0;
    return errno == EEXIST ? 0 : errno;
}

/* rename ``tmp`` onto ``final``, making ``final``'s directory where it is missing; 0 or
 * errno. (Tried three times: a directory may be emptied and removed between its mkdir and
 * the rename.) */
static int publish(const char *tmp, const char *final, int durable) {
    for (int attempt = 0; attempt < 3; attempt++) {
        if (rename(tmp, final) == 0) return 0;
        if (errno != ENOENT) return errno;
        char dir[PATH_MAX];
        if (!parent_of(final, dir)) return ENOENT;
        int rc = make_dirs(dir, durable, 0);
        if (rc) return rc;
    }
    return ENOENT;
}

static void write_item(witem_t *it) {
    const char *tmp = PyBytes_AS_STRING(it->tmp);
    const char *data = it->buf.buf;
    long long len = it->buf.len;
    int direct = it->direct && len >= ALIGN && (uintptr_t)data % ALIGN == 0;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
    if (fd < 0) { it->status = 1; it->err = errno; return; }
    long long body = direct ? len - len % ALIGN : len;
    int rc = pwrite_all(fd, data, body, 0);
    if (!rc && body < len) { /* the tail of an O_DIRECT write: one zero-padded block */
        void *block = NULL;
        if (posix_memalign(&block, ALIGN, ALIGN) != 0) rc = ENOMEM;
        else {
            memset(block, 0, ALIGN);
            memcpy(block, data + body, (size_t)(len - body));
            rc = pwrite_all(fd, block, ALIGN, body);
            free(block);
            if (!rc && ftruncate(fd, len) != 0) rc = errno;
        }
    }
    if (!rc && it->flush == 1 && fdatasync(fd) != 0) rc = errno;
    if (!rc && it->flush == 2 && fsync(fd) != 0) rc = errno;
    if (close(fd) != 0 && !rc) rc = errno;
    if (!rc) rc = publish(tmp, PyBytes_AS_STRING(it->final), it->flush == 2);
    if (rc) { unlink(tmp); it->status = 1; it->err = rc; return; }
    it->status = 0;
    it->err = 0;
}

static void release_witems(witem_t *items, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(items[i].tmp);
        Py_XDECREF(items[i].final);
        if (items[i].has_buf) PyBuffer_Release(&items[i].buf);
    }
    PyMem_Free(items);
}

/* The ``(status, errno)`` list of written items (GIL held); NULL with an exception set. */
static PyObject *write_results(witem_t *items, Py_ssize_t count) {
    PyObject *out = PyList_New(count);
    for (Py_ssize_t i = 0; out && i < count; i++) {
        PyObject *r = Py_BuildValue("(ii)", items[i].status, items[i].err);
        if (!r) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, r);
    }
    return out;
}

static witem_t *parse_witems(PyObject *arg, Py_ssize_t *count_out);

static PyObject *write_files(PyObject *self, PyObject *arg) {
    Py_ssize_t count = 0;
    witem_t *items = parse_witems(arg, &count);
    if (!items) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) write_item(&items[i]);
    Py_END_ALLOW_THREADS
    PyObject *out = write_results(items, count);
    release_witems(items, count);
    return out;
}

/* One item of a ``start_write_files`` job, queued for the writer thread its final path
 * hashes to. */
typedef struct wtask {
    witem_t *item;
    struct WriteJob *job;
    struct wtask *next;
} wtask_t;

/* ``start_write_files``' job: its items, written by the module's writer threads. */
typedef struct WriteJob {
    PyObject_HEAD
    witem_t *items;
    wtask_t *tasks;
    Py_ssize_t count;
    Py_ssize_t remaining; /* items not yet ended (guarded by writer_lock) */
    double start_by;    /* CLOCK_MONOTONIC seconds (Python's ``time.monotonic``) */
    double began, ended; /* -1: never begun (late) / not yet */
    atomic_int begun;   /* 0 undecided, 1 begun, 2 late: decided once, by its first item */
    atomic_int done;    /* every write has ended (set last, by the writer of its last item) */
} WriteJob;

/* WRITERS writer threads, started at the first job and kept: a thread made per job starts
 * behind every runnable thread of a loaded machine (a new thread is queued last), where a
 * thread that waits on a condition is woken ahead. A job's items are written side by side
 * (a new object's directory, inode and blocks are each a device round trip: three objects
 * of 260 KiB took 1.5 ms one after the other, 1.1 ms on several threads); an item goes to
 * the writer its final path hashes to, each writer taking its items in submission order, so
 * the writes of one key still end in the order they were started. */
#define WRITERS 4
static pthread_mutex_t writer_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t writer_wake[WRITERS]; /* (made as each writer starts) */
static pthread_cond_t writer_done = PTHREAD_COND_INITIALIZER;  /* a job ended */
static wtask_t *queue_head[WRITERS], *queue_tail[WRITERS];
static int writers_running = 0; /* threads started (the first ``writers_running`` indices) */

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whether ``job`` begins (its first item decides, once: not past ``start_by``). */
static int job_begins(WriteJob *job) {
    int state = atomic_load_explicit(&job->begun, memory_order_acquire);
    if (state == 0) {
        double now = monotonic_now();
        int want = now <= job->start_by ? 1 : 2, expected = 0;
        if (atomic_compare_exchange_strong(&job->begun, &expected, want)) {
            if (want == 1) job->began = now; /* (read once the job is done) */
            state = want;
        } else {
            state = expected;
        }
    }
    return state == 1;
}

/* The writes of a job run on the caller's thread (no writer thread to be had), GIL released. */
static void run_writes(WriteJob *job) {
    if (job_begins(job)) { /* else late: nothing is written (every item status 2) */
        for (Py_ssize_t i = 0; i < job->count; i++) write_item(&job->items[i]);
        job->ended = monotonic_now();
    }
}

/* One item ended (writer_lock held): the job is done when it was its last. */
static void task_ended(WriteJob *job, int begun) {
    if (--job->remaining == 0) {
        if (begun) job->ended = monotonic_now();
        atomic_store_explicit(&job->done, 1, memory_order_release);
        pthread_cond_broadcast(&writer_done);
    }
}

static void *writer_main(void *arg) {
    int w = (int)(intptr_t)arg;
    pthread_mutex_lock(&writer_lock);
    for (;;) {
        while (!queue_head[w]) pthread_cond_wait(&writer_wake[w], &writer_lock);
        wtask_t *task = queue_head[w];
        queue_head[w] = task->next;
        if (!queue_head[w]) queue_tail[w] = NULL;
        pthread_mutex_unlock(&writer_lock);
        int begun = job_begins(task->job);
        if (begun) write_item(task->item);
        pthread_mutex_lock(&writer_lock);
        task_ended(task->job, begun);
    }
    return NULL;
}

static void writer_after_fork(void) { /* the child has no writer threads: they start anew */
    pthread_mutex_init(&writer_lock, NULL);
    pthread_cond_init(&writer_done, NULL);
    writers_running = 0;
}

/* The writer of ``final`` (FNV-1a of the path): one key's writes always go to the same one. */
static int writer_of(PyObject *final, int writers) {
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(final);
    uint32_t h = 2166136261u;
    for (Py_ssize_t i = 0; i < PyBytes_GET_SIZE(final); i++) h = (h ^ p[i]) * 16777619u;
    return (int)(h % (uint32_t)writers);
}

/* Queue ``job``'s items for the writers (GIL held); 0, or -1 when no writer thread can be
 * had (then nothing was queued). */
static int queue_writes(WriteJob *job) {
    pthread_mutex_lock(&writer_lock);
    /* Started by the first job, as many as can be had (then their number is kept: one key
     * must always hash to the same writer). */
    for (int first = !writers_running; first && writers_running < WRITERS;) {
        pthread_t thread;
        int w = writers_running;
        queue_head[w] = queue_tail[w] = NULL;
        if (pthread_cond_init(&writer_wake[w], NULL) != 0) break;
        if (pthread_create(&thread, NULL, writer_main, (void *)(intptr_t)w) != 0) {
            pthread_cond_destroy(&writer_wake[w]);
            break;
        }
        pthread_detach(thread);
        writers_running++;
    }
    if (!writers_running) {
        pthread_mutex_unlock(&writer_lock);
        return -1;
    }
    job->remaining = job->count;
    int woken[WRITERS] = {0};
    for (Py_ssize_t i = 0; i < job->count; i++) {
        wtask_t *task = &job->tasks[i];
        int w = writer_of(job->items[i].final, writers_running);
        task->item = &job->items[i];
        task->job = job;
        task->next = NULL;
        if (queue_tail[w]) queue_tail[w]->next = task; else queue_head[w] = task;
        queue_tail[w] = task;
        woken[w] = 1;
    }
    for (int w = 0; w < WRITERS; w++)
        if (woken[w]) pthread_cond_signal(&writer_wake[w]);
    pthread_mutex_unlock(&writer_lock);
    return 0;
}

/* Wait until the writers have ended ``job``, GIL released (GIL held on entry and exit). */
static void join_writes(WriteJob *job) {
    if (atomic_load_explicit(&job->done, memory_order_acquire)) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&writer_lock);
    while (!atomic_load_explicit(&job->done, memory_order_acquire))
        pthread_cond_wait(&writer_done, &writer_lock);
    pthread_mutex_unlock(&writer_lock);
    Py_END_ALLOW_THREADS
}

static void WriteJob_dealloc(WriteJob *job) {
    join_writes(job); /* the buffers are read until the writes end: only then released */
    if (job->items) release_witems(job->items, job->count);
    PyMem_Free(job->tasks);
    Py_TYPE(job)->tp_free((PyObject *)job);
}

static PyObject *WriteJob_done(WriteJob *job, PyObject *unused) {
    return PyBool_FromLong(atomic_load_explicit(&job->done, memory_order_acquire));
}

static PyObject *WriteJob_wait(WriteJob *job, PyObject *unused) {
    join_writes(job);
    PyObject *out = write_results(job->items, job->count);
    PyObject *began = job->began < 0 ? Py_NewRef(Py_None) : PyFloat_FromDouble(job->began);
    PyObject *ended = job->ended < 0 ? Py_NewRef(Py_None) : PyFloat_FromDouble(job->ended);
    if (!out || !began || !ended) {
        Py_XDECREF(out); Py_XDECREF(began); Py_XDECREF(ended);
        return NULL;
    }
    return Py_BuildValue("(NNN)", out, began, ended);
}

static PyMethodDef writejob_methods[] = {
    {"done", (PyCFunction)WriteJob_done, METH_NOARGS, "done() -> bool: every write has ended."},
    {"wait", (PyCFunction)WriteJob_wait, METH_NOARGS,
     "wait() -> ([(status, errno)], began, ended): the writes' outcomes, once they ended."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WriteJobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_store.backends._fileio.WriteJob",
    .tp_basicsize = sizeof(WriteJob),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "File writes running on the module's writer thread (start_write_files).",
    .tp_dealloc = (destructor)WriteJob_dealloc,
    .tp_methods = writejob_methods,
};

/* Parse ``write_files`` items (GIL held); NULL with an exception set on a bad item. */
static witem_t *parse_witems(PyObject *arg, Py_ssize_t *count_out) {
    PyObject *seq = PySequence_Fast(arg, "write_files: items must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    witem_t *items = PyMem_Calloc(count ? count : 1, sizeof(witem_t));
    if (!items) { Py_DECREF(seq); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < count; i++) {
        witem_t *it = &items[i];
        PyObject *tmp, *final, *buf;
        it->status = 2; /* not attempted until written */
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OOOpi", &tmp, &final, &buf,
                              &it->direct, &it->flush)
            || !PyUnicode_FSConverter(tmp, &it->tmp) || !PyUnicode_FSConverter(final, &it->final)
            || PyObject_GetBuffer(buf, &it->buf, PyBUF_C_CONTIGUOUS) != 0) {
            release_witems(items, i + 1);
            Py_DECREF(seq);
            return NULL;
        }
        it->has_buf = 1;
    }
    Py_DECREF(seq);
    *count_out = count;
    return items;
}

static PyObject *start_write_files(PyObject *self, PyObject *args) {
    PyObject *arg;
    double start_by;
    if (!PyArg_ParseTuple(args, "Od", &arg, &start_by)) return NULL;
    Py_ssize_t count = 0;
    witem_t *items = parse_witems(arg, &count);
    if (!items) return NULL;
    wtask_t *tasks = PyMem_Calloc(count ? count : 1, sizeof(wtask_t));
    WriteJob *job = tasks ? PyObject_New(WriteJob, &WriteJobType) : NULL;
    if (!job) {
        PyMem_Free(tasks);
        release_witems(items, count);
        return tasks ? NULL : PyErr_NoMemory();
    }
    job->items = items;
    job->tasks = tasks;
    job->count = count;
    job->remaining = count;
    job->start_by = start_by;
    job->began = -1.0;
    job->ended = -1.0;
    atomic_init(&job->begun, 0);
    atomic_init(&job->done, 0);
    if (!count) { /* nothing to write: ended at once (begun unless already late) */
        if (job_begins(job)) job->ended = job->began;
        atomic_store_explicit(&job->done, 1, memory_order_release);
    } else if (queue_writes(job) != 0) { /* no thread to be had: written here, GIL released */
        Py_BEGIN_ALLOW_THREADS
        run_writes(job);
        Py_END_ALLOW_THREADS
        atomic_store_explicit(&job->done, 1, memory_order_release);
    }
    return (PyObject *)job;
}

/* ``spans`` of an item whose buffers are held: each (offset, length) inside one buffer. */
static int parse_spans(item_t *it, PyObject *spans) {
    PyObject *list = PySequence_Fast(spans, "read_files: spans must be a sequence");
    if (!list) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(list);
    if (n && !xxh3_64) {
        Py_DECREF(list);
        PyErr_SetString(PyExc_RuntimeError, "read_files: spans need bind_xxh3 first");
        return -1;
    }
    it->spans = PyMem_Calloc(n ? n : 1, sizeof(span_t));
    it->sums = PyMem_Calloc(n ? n : 1, sizeof(unsigned long long));
    if (!it->spans || !it->sums) { Py_DECREF(list); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long off, len;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(list, i), "LL", &off, &len)) {
            Py_DECREF(list);
            return -1;
        }
        long long base = 0;
        Py_ssize_t b = 0;
        while (b < it->nbufs && off >= base + it->bufs[b].len) base += it->bufs[b++].len;
        if (off < 0 || len < 0 || b == it->nbufs || off + len > base + it->bufs[b].len) {
            Py_DECREF(list);
            PyErr_Format(PyExc_ValueError,
                         "read_files: span (%lld, %lld) does not lie inside one buffer", off, len);
            return -1;
        }
        it->spans[i].at = (const char *)it->bufs[b].buf + (off - base);
        it->spans[i].offset = off;
        it->spans[i].length = len;
        it->nspans = i + 1;
    }
    Py_DECREF(list);
    return 0;
}

static PyObject *bind_xxh3(PyObject *self, PyObject *arg) {
    PyObject *path;
    if (!PyUnicode_FSConverter(arg, &path)) return NULL;
    /* RTLD_NOLOAD: only an object this process has already loaded (never a new one) */
    void *handle = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(path);
    void *fn = handle ? dlsym(handle, "XXH3_64bits") : NULL;
    if (fn) xxh3_64 = (xxh3_fn)fn; /* the handle stays open: the hash stays mapped */
    else if (handle) dlclose(handle);
    return PyBool_FromLong(xxh3_64 != NULL);
}

/* Parse ``read_files`` items (GIL held); NULL with an exception set on a bad item. */
static item_t *parse_items(PyObject *arg, Py_ssize_t *count_out) {
    PyObject *seq = PySequence_Fast(arg, "read_files: items must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    item_t *items = PyMem_Calloc(count ? count : 1, sizeof(item_t));
    if (!items) { Py_DECREF(seq); PyErr_NoMemory(); return NULL; }
    Py_ssize_t ready = 0;
    for (; ready < count; ready++) {
        item_t *it = &items[ready];
        PyObject *tuple = PySequence_Fast_GET_ITEM(seq, ready), *path, *bufs, *spans = NULL;
        int direct;
        if (!PyArg_ParseTuple(tuple, "OOLLp|O", &path, &bufs, &it->start, &it->length, &direct,
                              &spans))
            goto fail;
        it->direct = direct;
        if (!PyUnicode_FSConverter(path, &it->path)) goto fail;
        PyObject *blist = PySequence_Fast(bufs, "read_files: buffers must be a sequence");
        if (!blist) goto fail;
        Py_ssize_t nb = PySequence_Fast_GET_SIZE(blist);
        if (nb > MAX_IOV) {
            Py_DECREF(blist);
            PyErr_Format(PyExc_ValueError, "read_files: %zd buffers (at most %d)", nb, MAX_IOV);
            goto fail;
        }
        it->bufs = PyMem_Calloc(nb ? nb : 1, sizeof(Py_buffer));
        if (!it->bufs) { Py_DECREF(blist); PyErr_NoMemory(); goto fail; }
        for (Py_ssize_t b = 0; b < nb; b++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(blist, b), &it->bufs[b],
                                   PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
                Py_DECREF(blist);
                goto fail;
            }
            it->nbufs = b + 1;
        }
        Py_DECREF(blist);
        if (spans && spans != Py_None && parse_spans(it, spans) != 0) goto fail;
    }
    Py_DECREF(seq);
    *count_out = count;
    return items;
fail:
    release_items(items, ready + 1 <= count ? ready + 1 : count);
    Py_DECREF(seq);
    return NULL;
}

/* The ``(status, value, size, flags, sums)`` list of read items (GIL held). */
static PyObject *results_of(item_t *items, Py_ssize_t count) {
    PyObject *out = PyList_New(count);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *sums = PyTuple_New(items[i].summed ? items[i].nspans : 0);
        for (Py_ssize_t k = 0; sums && items[i].summed && k < items[i].nspans; k++) {
            PyObject *v = PyLong_FromUnsignedLongLong(items[i].sums[k]);
            if (!v) { Py_CLEAR(sums); break; }
            PyTuple_SET_ITEM(sums, k, v);
        }
        PyObject *r = sums ? Py_BuildValue("(iLLiN)", items[i].status, items[i].value,
                                           items[i].size, items[i].flags, sums) : NULL;
        if (!r) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, r);
    }
    return out;
}

static PyObject *read_files(PyObject *self, PyObject *arg) {
    Py_ssize_t count = 0;
    item_t *items = parse_items(arg, &count);
    if (!items) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) read_item(&items[i]);
    Py_END_ALLOW_THREADS
    PyObject *out = results_of(items, count);
    release_items(items, count);
    return out;
}

/* ``start_read_files``' job: its items, read by a thread of its own. */
typedef struct {
    PyObject_HEAD
    item_t *items;
    Py_ssize_t count;
    pthread_t thread;
    int running;        /* a thread was started and not joined yet */
    atomic_int done;    /* every read has ended (set last by the thread) */
} ReadJob;

static void *run_reads(void *arg) {
    ReadJob *job = (ReadJob *)arg;
    for (Py_ssize_t i = 0; i < job->count; i++) read_item(&job->items[i]);
    atomic_store_explicit(&job->done, 1, memory_order_release);
    return NULL;
}

/* Wait for the job's thread, GIL released (GIL held on entry and exit). */
static void join_reads(ReadJob *job) {
    if (!job->running) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_join(job->thread, NULL);
    Py_END_ALLOW_THREADS
    job->running = 0;
}

static void ReadJob_dealloc(ReadJob *job) {
    join_reads(job); /* the buffers are written until the reads end: only then released */
    if (job->items) release_items(job->items, job->count);
    Py_TYPE(job)->tp_free((PyObject *)job);
}

static PyObject *ReadJob_done(ReadJob *job, PyObject *unused) {
    return PyBool_FromLong(atomic_load_explicit(&job->done, memory_order_acquire));
}

static PyObject *ReadJob_wait(ReadJob *job, PyObject *unused) {
    join_reads(job);
    return results_of(job->items, job->count);
}

static PyMethodDef readjob_methods[] = {
    {"done", (PyCFunction)ReadJob_done, METH_NOARGS, "done() -> bool: every read has ended."},
    {"wait", (PyCFunction)ReadJob_wait, METH_NOARGS,
     "wait() -> [(status, value, size, flags, sums)]: the reads' outcomes, once they ended."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReadJobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_store.backends._fileio.ReadJob",
    .tp_basicsize = sizeof(ReadJob),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "File reads running on a thread of their own (start_read_files).",
    .tp_dealloc = (destructor)ReadJob_dealloc,
    .tp_methods = readjob_methods,
};

static PyObject *start_read_files(PyObject *self, PyObject *arg) {
    Py_ssize_t count = 0;
    item_t *items = parse_items(arg, &count);
    if (!items) return NULL;
    ReadJob *job = PyObject_New(ReadJob, &ReadJobType);
    if (!job) { release_items(items, count); return NULL; }
    job->items = items;
    job->count = count;
    job->running = 0;
    atomic_init(&job->done, 0);
    if (pthread_create(&job->thread, NULL, run_reads, job) == 0) {
        job->running = 1;
    } else { /* no thread to be had: read here, GIL released, and hand back a finished job */
        Py_BEGIN_ALLOW_THREADS
        run_reads(job);
        Py_END_ALLOW_THREADS
    }
    return (PyObject *)job;
}

static PyMethodDef methods[] = {
    {"read_files", read_files, METH_O,
     "read_files(items) -> [(status, value, size, flags, sums)]: file reads, GIL released."},
    {"start_read_files", start_read_files, METH_O,
     "start_read_files(items) -> ReadJob: read_files on a thread of its own, without the GIL."},
    {"write_files", write_files, METH_O,
     "write_files(items) -> [(status, errno)]: temp-file writes and renames, GIL released."},
    {"start_write_files", start_write_files, METH_VARARGS,
     "start_write_files(items, start_by) -> WriteJob: write_files on a thread of its own."},
    {"bind_xxh3", bind_xxh3, METH_O,
     "bind_xxh3(path) -> bool: take XXH3_64bits from the loaded shared object path."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fileio", "Batched file reads (and their checksums) and writes without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__fileio(void) {
    if (PyType_Ready(&ReadJobType) < 0 || PyType_Ready(&WriteJobType) < 0) return NULL;
    pthread_atfork(NULL, NULL, writer_after_fork);
    return PyModule_Create(&module);
}
