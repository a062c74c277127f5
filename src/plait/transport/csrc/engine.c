/* plait.transport._engine: the compiled data path of the direct shared-memory collectives.
 *
 * A Board runs whole collectives among the ranks of one host through the slots of the
 * host's segment (layout in plait/transport/shm.py: 64 int64 control words per rank,
 * then two banks of one slot per rank). One operation, sequence number s:
 *
 *   1. wait until every rank has finished operation s-2 (its done word >= s-2): the
 *      slots of bank s&1 are free again;
 *   2. write this rank's contribution into its slot, store s into its arrive word,
 *      ring every peer's doorbell;
 *   3. wait until the ranks it needs have arrived (arrive >= s);
 *   4. read their slots (copy or reduce, in rank order: bit-identical on every rank),
 *      store s into its done word, wake peers that sleep.
 *
 * Waits are resumable: run()/resume() return 0 when the operation is complete and 1 when
 * a wait spun for its budget without the condition holding (or an abort notice
 * appeared). The caller then checks health and the deadline in Python, sleeps with
 * sleep() (futex, GIL released) and calls resume(). That keeps every error, its typed
 * exception and its message in one place (plait.health), while the common case, a peer
 * that arrives within the spin, is one call from Python to the finished result.
 *
 * Memory ordering: arrive/done words and the doorbell use sequentially consistent
 * atomics. A sleeper sets its sleeping flag, then reads the doorbell, then re-checks its
 * condition; a publisher stores its word, bumps the doorbell, then reads the flag. Under
 * a single total order either the sleeper sees the new word or the publisher sees the
 * flag and wakes it, so no wake-up is lost (every sleep is also bounded by its timeout).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "reduce.h"

/* control words per rank and their indices: must match plait/transport/shm.py */
#define CTL_WORDS 64
#define W_BELL 0
#define W_ARRIVE 2
#define W_PID 6
#define W_DONE 3
#define W_ABORT 7
#define W_REDUCED 11
#define W_ADDR 12    /* in-place allreduce: where this rank's buffer is, in its memory */
#define W_CMA_OK 13  /* bit k: this rank reads local rank k's memory; bit 62: computed */
#define W_NONCE 16
#define W_NONCE_ADDR 17

/* operation codes: must match plait/transport/engine.py */
enum { MODE_DIRECT, MODE_SLICES, MODE_INPLACE };

enum { OP_ALLREDUCE, OP_REDUCE, OP_BROADCAST, OP_ALLGATHERV, OP_GATHER, OP_SCATTER,
       OP_REDUCE_SCATTER, OP_ALLTOALL, OP_BARRIER, OP_COUNT };

/* Above this many bytes a copy or a reduction releases the GIL: below it, releasing and
 * re-taking the GIL costs more than other threads gain. */
#define GIL_FREE_BYTES (64u << 10)

/* An operation moving at least this many bytes per rank runs without the GIL from its
 * first piece to its last (or to a wait that outlasts the spin). */
#define GIL_OP_BYTES (256u << 10)

/* In-place allreduce: peers' data is read in chunks of this many bytes per peer into a
 * scratch buffer (n-1 chunks: all rows of a chunk are folded at once, so 16-bit floats are
 * still rounded once) and reduced from there while it is in L2. */
#define CMA_CHUNK (256u << 10)
#define CMA_COMPUTED (1LL << 62)

/* Spin this long holding the GIL before releasing it for the rest of the spin: a peer
 * that is already on its way arrives within it, and the call then returns without
 * touching the thread state. */
#define HELD_SPIN_NS 3000u

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

typedef struct {
    PyObject_HEAD
    Py_buffer seg;      /* held export of the segment's mapping: it cannot be unmapped */
    int held;           /* seg is held */
    int n, me;
    int64_t *ctl;       /* n rows of CTL_WORDS */
    char *slots;        /* 2 banks x n slots */
    size_t slot_size;
    uint64_t spin_ns;
    int yield_cpu;      /* more ranks than cores: yield the core while spinning */
    const void **rows;  /* n row pointers for reductions (no allocation mid-operation) */
    int64_t seq;        /* sequence number of the last piece begun */
    /* the operation in progress */
    int stage;          /* 0 none; waiting for: 1 free slots, 2 arrivals, 3 reduced slices,
                           4 (in place) every peer done reading this rank's buffer */
    int code, dtype, rop, root;
    int needs;          /* -1: every rank, -2: none, else that one rank */
    int slices;         /* allreduce by slices: reduce-scatter then allgather per piece */
    int inplace;        /* allreduce by slices read straight from the peers' buffers */
    int err;            /* errno of a failed process_vm_readv (the operation failed) */
    int errpeer;
    int64_t cma_mask;   /* W_CMA_OK of this rank once computed, else 0 */
    char *scratch;      /* (n-1) x CMA_CHUNK, allocated at the first in-place operation */
    long long fallbacks; /* in-place operations that ran through the slots instead */
    int gil;            /* the GIL is held while the operation advances */
    Py_buffer send, recv;
    int has_send, has_recv;
    Py_ssize_t *counts; /* allgatherv: elements from each rank */
    size_t isz;
    size_t step;        /* bytes of each rank's block that one piece moves */
    int64_t piece, npieces;
} Board;

static inline _Atomic int64_t *word(Board *b, int rank, int w)
{
    return (_Atomic int64_t *)(b->ctl + (size_t)rank * CTL_WORDS + w);
}

/* a rank's doorbell: [0] the futex word, [1] its "sleeping" flag */
static inline _Atomic int32_t *bell(Board *b, int rank)
{
    return (_Atomic int32_t *)(b->ctl + (size_t)rank * CTL_WORDS + W_BELL);
}

static inline char *slot(Board *b, int64_t s, int rank)
{
    return b->slots + ((size_t)(s & 1) * (size_t)b->n + (size_t)rank) * b->slot_size;
}

static void futex_wake(_Atomic int32_t *addr)
{
    syscall(SYS_futex, (void *)addr, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static void ring(Board *b, int rank, int always)
{
    _Atomic int32_t *w = bell(b, rank);
    if (always) {
        atomic_fetch_add(&w[0], 1);
        if (atomic_load(&w[1]))
            futex_wake(&w[0]);
    } else if (atomic_load(&w[1])) {
        atomic_fetch_add(&w[0], 1);
        futex_wake(&w[0]);
    }
}

/* whether rank k holds up the pending wait */
static int late(Board *b, int k)
{
    switch (b->stage) {
    case 1:
        return atomic_load(word(b, k, W_DONE)) < b->seq - 2;
    case 2:
        return (b->needs == -1 || b->needs == k) && atomic_load(word(b, k, W_ARRIVE)) < b->seq;
    case 3:
        return atomic_load(word(b, k, W_REDUCED)) < b->seq;
    case 4:
        return atomic_load(word(b, k, W_DONE)) < b->seq;
    default:
        return 0;
    }
}

static int ready(Board *b)
{
    if (b->stage == 2 && b->needs != -1)
        return b->needs == -2 || !late(b, b->needs);
    for (int k = 0; k < b->n; k++)
        if (late(b, k))
            return 0;
    return 1;
}

static int aborted(Board *b)
{
    for (int k = 0; k < b->n; k++)
        if (atomic_load_explicit(word(b, k, W_ABORT), memory_order_relaxed))
            return 1;
    return 0;
}

/* Spin until ready (1) or until the budget is spent or an abort notice appears (0). */
static int spin_loop(Board *b, uint64_t t0, uint64_t until)
{
    for (unsigned i = 1;; i++) {
        if (ready(b))
            return 1;
        if (b->yield_cpu)
            sched_yield();
        else
            cpu_relax();
        if ((i & 63) == 0) {
            if (now_ns() - t0 >= until || aborted(b))
                return 0;
        }
    }
}

static int spin(Board *b)
{
    if (ready(b))
        return 1;
    uint64_t t0 = now_ns();
    if (!b->gil)
        return spin_loop(b, t0, b->spin_ns);
    uint64_t held = b->spin_ns < HELD_SPIN_NS ? b->spin_ns : HELD_SPIN_NS;
    if (spin_loop(b, t0, held))
        return 1;
    if (b->spin_ns <= held)
        return 0;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = spin_loop(b, t0, b->spin_ns);
    Py_END_ALLOW_THREADS
    return ok;
}

/* -- what each piece writes and reads --------------------------------------------------- */

static void copy(Board *b, void *dst, const void *src, size_t n)
{
    if (n >= GIL_FREE_BYTES && b->gil) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, n);
        Py_END_ALLOW_THREADS
    } else if (n) {
        memcpy(dst, src, n);
    }
}

/* out = fold of b->rows[0..n) over count elements */
static void fold(Board *b, void *out, size_t count)
{
    if (count * b->isz >= GIL_FREE_BYTES && b->gil) {
        Py_BEGIN_ALLOW_THREADS
        pl_reduce_rows(b->dtype, b->rop, out, b->rows, b->n, count);
        Py_END_ALLOW_THREADS
    } else {
        pl_reduce_rows(b->dtype, b->rop, out, b->rows, b->n, count);
    }
}

/* every rank's slot of this piece from byte ``off``, folded in rank order into out */
static void reduce_slots(Board *b, void *out, size_t off, size_t count)
{
    for (int k = 0; k < b->n; k++)
        b->rows[k] = slot(b, b->seq, k) + off;
    fold(b, out, count);
}

/* The part [*off, *off + return) of a block of ``total`` bytes that this piece moves. */
static size_t span(Board *b, size_t total, size_t *off)
{
    size_t o = (size_t)b->piece * b->step;
    if (o >= total) {
        *off = total;
        return 0;
    }
    *off = o;
    return total - o < b->step ? total - o : b->step;
}

/* slice k of a piece of m elements: [start, start + return) */
static size_t slice(size_t m, int n, int k, size_t *start)
{
    size_t base = m / (size_t)n, rem = m % (size_t)n, kk = (size_t)k;
    *start = kk * base + (kk < rem ? kk : rem);
    return base + (kk < rem);
}

/* n sub-blocks (one per rank, of ``c``-byte blocks) of this piece into dst, packed */
static void pack(Board *b, char *dst, const char *src, size_t c)
{
    size_t off, l = span(b, c, &off);
    for (int k = 0; k < b->n; k++)
        copy(b, dst + (size_t)k * l, src + (size_t)k * c + off, l);
}

/* before publishing: this rank's contribution to the piece into its slot */
static void write_own(Board *b)
{
    size_t off, l;
    if (b->inplace) {
        /* what peers read: the buffer for allreduce, reduce and broadcast, else the send
         * buffer (a rank that has none publishes 0; no one reads it) */
        int own = b->code == OP_ALLREDUCE || b->code == OP_REDUCE || b->code == OP_BROADCAST;
        void *src = own ? (b->has_recv ? b->recv.buf : NULL) : (b->has_send ? b->send.buf : NULL);
        atomic_store(word(b, b->me, W_ADDR), (int64_t)(intptr_t)src);
        atomic_store(word(b, b->me, W_CMA_OK), b->cma_mask);
        return;
    }
    char *mine = slot(b, b->seq, b->me);
    switch (b->code) {
    case OP_ALLREDUCE:
    case OP_REDUCE:
        l = span(b, (size_t)b->recv.len, &off);
        copy(b, mine, (char *)b->recv.buf + off, l);
        break;
    case OP_BROADCAST:
        if (b->me == b->root) {
            l = span(b, (size_t)b->recv.len, &off);
            copy(b, mine, (char *)b->recv.buf + off, l);
        }
        break;
    case OP_ALLGATHERV:
    case OP_GATHER:
        l = span(b, (size_t)b->send.len, &off);
        copy(b, mine, (char *)b->send.buf + off, l);
        break;
    case OP_SCATTER:
        if (b->me == b->root) {
            size_t c = (size_t)b->recv.len;
            pack(b, mine, b->send.buf, c);
            l = span(b, c, &off);
            copy(b, (char *)b->recv.buf + off, (char *)b->send.buf + (size_t)b->me * c + off, l);
        }
        break;
    case OP_REDUCE_SCATTER:
        pack(b, mine, b->send.buf, (size_t)b->recv.len);
        break;
    case OP_ALLTOALL:
        pack(b, mine, b->send.buf, (size_t)b->recv.len / (size_t)b->n);
        break;
    default:
        break;
    }
}

/* once the needed ranks have arrived: read their slots for this piece */
static void read_peers(Board *b)
{
    char *out = b->has_recv ? b->recv.buf : NULL;
    int64_t s = b->seq;
    size_t off, l;
    switch (b->code) {
    case OP_ALLREDUCE:
    case OP_REDUCE:
        if (b->code == OP_ALLREDUCE || b->me == b->root) {
            l = span(b, (size_t)b->recv.len, &off);
            reduce_slots(b, out + off, 0, l / b->isz);
        }
        break;
    case OP_BROADCAST:
        if (b->me != b->root) {
            l = span(b, (size_t)b->recv.len, &off);
            copy(b, out + off, slot(b, s, b->root), l);
        }
        break;
    case OP_SCATTER:
        if (b->me != b->root) {
            l = span(b, (size_t)b->recv.len, &off);
            copy(b, out + off, slot(b, s, b->root) + (size_t)b->me * l, l);
        }
        break;
    case OP_ALLGATHERV: {
        size_t disp = 0;
        for (int k = 0; k < b->n; k++) {
            size_t c = (size_t)b->counts[k] * b->isz;
            l = span(b, c, &off);
            copy(b, out + disp + off, slot(b, s, k), l);
            disp += c;
        }
        break;
    }
    case OP_GATHER:
        if (b->me == b->root) {
            size_t c = (size_t)b->send.len;
            l = span(b, c, &off);
            for (int k = 0; k < b->n; k++)
                copy(b, out + (size_t)k * c + off, slot(b, s, k), l);
        }
        break;
    case OP_REDUCE_SCATTER:
        l = span(b, (size_t)b->recv.len, &off);
        reduce_slots(b, out + off, (size_t)b->me * l, l / b->isz);
        break;
    case OP_ALLTOALL: {
        size_t c = (size_t)b->recv.len / (size_t)b->n;
        l = span(b, c, &off);
        for (int k = 0; k < b->n; k++)
            copy(b, out + (size_t)k * c + off, slot(b, s, k) + (size_t)b->me * l, l);
        break;
    }
    default:
        break;
    }
}

/* allreduce by slices, once every rank's piece is in: this rank's slice of the piece,
 * reduced in place in its own slot (no one else reads that part of it). Rows are this
 * rank's first, then the others in rank order: each slice is reduced by one rank only,
 * so every rank still gets the same bits. */
static void reduce_my_slice(Board *b)
{
    size_t off, m = span(b, (size_t)b->recv.len, &off) / b->isz, start;
    size_t len = slice(m, b->n, b->me, &start);
    size_t at = start * b->isz;
    b->rows[0] = slot(b, b->seq, b->me) + at;
    for (int k = 0, r = 1; k < b->n; k++)
        if (k != b->me)
            b->rows[r++] = slot(b, b->seq, k) + at;
    fold(b, (void *)b->rows[0], len);
}

/* allreduce by slices, once every slice is reduced: all of them into the result */
static void gather_slices(Board *b)
{
    size_t off, m = span(b, (size_t)b->recv.len, &off) / b->isz, start;
    char *out = (char *)b->recv.buf + off;
    for (int k = 0; k < b->n; k++) {
        size_t len = slice(m, b->n, k, &start);
        copy(b, out + start * b->isz, slot(b, b->seq, k) + start * b->isz, len * b->isz);
    }
}

/* -- in place: single copies with process_vm_readv ------------------------------------- */

static int peer_read(Board *b, int k, void *dst, int64_t remote, size_t n)
{
    pid_t pid = (pid_t)atomic_load(word(b, k, W_PID));
    while (n > 0) {
        struct iovec here = {dst, n}, there = {(void *)(intptr_t)remote, n};
        ssize_t got = process_vm_readv(pid, &here, 1, &there, 1, 0);
        if (got <= 0) {
            if (got < 0 && errno == EINTR)
                continue;
            b->err = got < 0 ? errno : EIO;
            b->errpeer = k;
            return -1;
        }
        dst = (char *)dst + got;
        remote += got;
        n -= (size_t)got;
    }
    return 0;
}

/* This rank's readability of every peer: the nonce each peer wrote at an address of its
 * own memory, read back through process_vm_readv (fails across PID namespaces, under
 * Yama ptrace restrictions and seccomp filters). */
static int64_t cma_probe(Board *b)
{
    int64_t mask = CMA_COMPUTED;
    for (int k = 0; k < b->n; k++) {
        int64_t got = 0, want = atomic_load(word(b, k, W_NONCE));
        if (k == b->me) {
            mask |= 1LL << k;
            continue;
        }
        struct iovec here = {&got, sizeof got};
        struct iovec there = {(void *)(intptr_t)atomic_load(word(b, k, W_NONCE_ADDR)), 8};
        pid_t pid = (pid_t)atomic_load(word(b, k, W_PID));
        if (want != 0 && process_vm_readv(pid, &here, 1, &there, 1, 0) == 8 && got == want)
            mask |= 1LL << k;
    }
    return mask;
}

/* after the arrivals: can every rank read every other? (the same answer on every rank:
 * each reads the words all ranks published before arriving) */
static int all_readable(Board *b)
{
    int64_t all = (int64_t)((1ULL << b->n) - 1) | CMA_COMPUTED;
    for (int k = 0; k < b->n; k++)
        if ((atomic_load(word(b, k, W_CMA_OK)) & all) != all)
            return 0;
    return 1;
}

/* ``len`` bytes from offset ``off`` of the buffer rank k published */
static int read_from(Board *b, int k, void *dst, size_t off, size_t len)
{
    if (len == 0)
        return 0;
    if (k == b->me) {
        /* this rank's own part: a local copy (memmove: in-place calls alias it) */
        const char *src = (const char *)(intptr_t)atomic_load(word(b, k, W_ADDR)) + off;
        if (src != dst)
            memmove(dst, src, len);
        return 0;
    }
    return peer_read(b, k, dst, atomic_load(word(b, k, W_ADDR)) + (int64_t)off, len);
}

/* block ``[off, off + count)`` elements of every rank's published buffer (at byte
 * ``base`` in it), folded into out: this rank's row first, then the others in rank order,
 * in chunks read through the scratch buffer */
static int reduce_from_peers(Board *b, char *out, size_t base, size_t count)
{
    size_t chunk = CMA_CHUNK / b->isz;
    const char *mine = (const char *)(intptr_t)atomic_load(word(b, b->me, W_ADDR)) + base;
    for (size_t off = 0; off < count; off += chunk) {
        size_t m = count - off < chunk ? count - off : chunk;
        if (out + off * b->isz != mine + off * b->isz)
            memmove(out + off * b->isz, mine + off * b->isz, m * b->isz);
        b->rows[0] = out + off * b->isz;
        for (int k = 0, r = 1; k < b->n; k++) {
            if (k == b->me)
                continue;
            char *dst = b->scratch + (size_t)(r - 1) * CMA_CHUNK;
            if (read_from(b, k, dst, base + off * b->isz, m * b->isz) < 0)
                return -1;
            b->rows[r++] = dst;
        }
        fold(b, (void *)b->rows[0], m);
    }
    return 0;
}

/* every operation but allreduce, in place: what this rank needs, read straight from the
 * buffers the needed ranks published */
static int moves_inplace(Board *b)
{
    char *out = b->has_recv ? b->recv.buf : NULL;
    size_t n = (size_t)b->n, c;
    int me = b->me;
    switch (b->code) {
    case OP_BROADCAST:
        return me == b->root ? 0 : read_from(b, b->root, out, 0, (size_t)b->recv.len);
    case OP_SCATTER:
        c = (size_t)b->recv.len;
        return read_from(b, b->root, out, (size_t)me * c, c);
    case OP_ALLGATHERV: {
        size_t disp = 0;
        for (int k = 0; k < b->n; k++) {
            c = (size_t)b->counts[k] * b->isz;
            if (read_from(b, k, out + disp, 0, c) < 0)
                return -1;
            disp += c;
        }
        return 0;
    }
    case OP_GATHER:
        if (me != b->root)
            return 0;
        c = (size_t)b->send.len;
        for (int k = 0; k < b->n; k++)
            if (read_from(b, k, out + (size_t)k * c, 0, c) < 0)
                return -1;
        return 0;
    case OP_ALLTOALL:
        c = (size_t)b->recv.len / n;
        for (int k = 0; k < b->n; k++)
            if (read_from(b, k, out + (size_t)k * c, (size_t)me * c, c) < 0)
                return -1;
        return 0;
    case OP_REDUCE_SCATTER:
        c = (size_t)b->recv.len;
        return reduce_from_peers(b, out, (size_t)me * c, c / b->isz);
    case OP_REDUCE:
        if (me != b->root)
            return 0;
        return reduce_from_peers(b, out, 0, (size_t)b->recv.len / b->isz);
    default:
        return 0;
    }
}

/* allreduce in place, once every rank has arrived: this rank's slice of the whole
 * buffer, reduced from the peers' buffers into its own */
static int reduce_my_slice_inplace(Board *b)
{
    size_t start, len = slice((size_t)b->recv.len / b->isz, b->n, b->me, &start);
    return reduce_from_peers(b, (char *)b->recv.buf + start * b->isz, start * b->isz, len);
}

/* allreduce in place, once every slice is reduced: the others' slices straight into
 * this rank's buffer (its own is already there) */
static int gather_slices_inplace(Board *b)
{
    size_t count = (size_t)b->recv.len / b->isz, start;
    for (int k = 0; k < b->n; k++) {
        size_t len = slice(count, b->n, k, &start);
        if (read_from(b, k, (char *)b->recv.buf + start * b->isz, start * b->isz,
                      len * b->isz) < 0)
            return -1;
    }
    return 0;
}

static void release_op(Board *b)
{
    if (b->has_send)
        PyBuffer_Release(&b->send);
    if (b->has_recv)
        PyBuffer_Release(&b->recv);
    b->has_send = b->has_recv = 0;
    PyMem_Free(b->counts);
    b->counts = NULL;
    b->stage = 0;
}

/* Store this rank's word and ring its peers: every peer after an arrival or a reduced
 * slice (a waiter may be spinning on it), only sleeping ones after done. */
static void announce(Board *b, int w, int always)
{
    atomic_store(word(b, b->me, w), b->seq);
    for (int k = 0; k < b->n; k++)
        if (k != b->me)
            ring(b, k, always);
}

/* Run the operation in progress as far as it goes: 0 complete, 1 a wait is pending, -1
 * failed (b->err).
 * Each piece has its own sequence number and uses bank seq & 1. */
static int advance(Board *b)
{
    for (;;) {
        if (b->stage == 1) {
            if (!spin(b))
                return 1;
            write_own(b);
            announce(b, W_ARRIVE, 1);
            b->stage = 2;
        }
        if (b->stage == 2) {
            if (!spin(b))
                return 1;
            if (b->inplace && !all_readable(b)) {
                /* some pair cannot read the other: the same operation by slices through
                 * the slots (every rank sees the same words, so every rank switches) */
                announce(b, W_DONE, 0);
                b->fallbacks++;
                b->inplace = 0;
                b->slices = b->code == OP_ALLREDUCE;
                b->piece = 0;
                b->seq += 1;
                b->stage = 1;
                continue;
            }
            if (b->inplace && b->code != OP_ALLREDUCE) {
                if (moves_inplace(b) < 0)
                    return -1;
                /* the buffer goes back to the caller once every reader is done */
                announce(b, W_DONE, 1);
                b->stage = 4;
            } else if (b->inplace) {
                if (reduce_my_slice_inplace(b) < 0)
                    return -1;
                announce(b, W_REDUCED, 1);
                b->stage = 3;
            } else if (b->slices) {
                reduce_my_slice(b);
                announce(b, W_REDUCED, 1);
                b->stage = 3;
            } else {
                read_peers(b);
            }
        }
        if (b->stage == 3) {
            if (!spin(b))
                return 1;
            if (b->inplace) {
                if (gather_slices_inplace(b) < 0)
                    return -1;
                /* peers may still be reading this rank's slice: the buffer goes back to
                 * the caller only once every rank is done */
                announce(b, W_DONE, 1);
                b->stage = 4;
            } else {
                gather_slices(b);
            }
        }
        if (b->stage == 4) {
            if (!spin(b))
                return 1;
            return 0;
        }
        announce(b, W_DONE, 0);
        if (++b->piece >= b->npieces)
            return 0;
        b->seq += 1;
        b->stage = 1;
    }
}

/* advance, without the GIL for the whole operation when it is large (its copies and
 * reductions then run while other Python threads go on); never touches Python objects */
static int run_advance(Board *b)
{
    if (b->gil)
        return advance(b);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = advance(b);
    Py_END_ALLOW_THREADS
    return rc;
}

/* run_advance, then (with the GIL) let go of a finished operation's buffers */
static int step_op(Board *b)
{
    int rc = run_advance(b);
    if (rc < 0) {
        errno = b->err;
        PyErr_Format(PyExc_OSError, "engine: reading local rank %d's memory "
                     "(process_vm_readv) failed: %s", b->errpeer, strerror(b->err));
    }
    if (rc == 0 || PyErr_Occurred())
        release_op(b);
    return rc;
}

/* -- the Python type ------------------------------------------------------------------ */

static int Board_init(Board *b, PyObject *args, PyObject *kw)
{
    static char *names[] = {"segment", "n", "me", "ctl_offset", "slots_offset", "slot_size",
                            "spin_ns", "yield_cpu", NULL};
    PyObject *seg;
    Py_ssize_t ctl_off, slots_off, slot_size;
    unsigned long long spin_ns;
    int n, me, yield_cpu;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiinnnKp", names, &seg, &n, &me, &ctl_off,
                                     &slots_off, &slot_size, &spin_ns, &yield_cpu))
        return -1;
    if (b->held) {
        PyErr_SetString(PyExc_RuntimeError, "Board is already initialised");
        return -1;
    }
    if (n < 1 || me < 0 || me >= n || ctl_off < 0 || slots_off < 0 || slot_size < 0) {
        PyErr_SetString(PyExc_ValueError, "Board: bad geometry");
        return -1;
    }
    if (PyObject_GetBuffer(seg, &b->seg, PyBUF_WRITABLE) < 0)
        return -1;
    b->held = 1;
    Py_ssize_t need_ctl = ctl_off + (Py_ssize_t)n * CTL_WORDS * 8;
    Py_ssize_t need_slots = slots_off + 2 * (Py_ssize_t)n * slot_size;
    if (need_ctl > b->seg.len || need_slots > b->seg.len || (ctl_off & 7)) {
        PyBuffer_Release(&b->seg);
        b->held = 0;
        PyErr_SetString(PyExc_ValueError, "Board: the segment is smaller than its layout");
        return -1;
    }
    b->n = n;
    b->me = me;
    b->ctl = (int64_t *)((char *)b->seg.buf + ctl_off);
    b->slots = (char *)b->seg.buf + slots_off;
    b->slot_size = (size_t)slot_size;
    b->spin_ns = spin_ns;
    b->yield_cpu = yield_cpu;
    b->seq = 0;
    b->stage = 0;
    b->rows = PyMem_Calloc((size_t)n, sizeof(void *));
    if (b->rows == NULL) {
        PyBuffer_Release(&b->seg);
        b->held = 0;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Board_dealloc(Board *b)
{
    release_op(b);
    PyMem_Free(b->rows);
    b->rows = NULL;
    PyMem_Free(b->scratch);
    b->scratch = NULL;
    if (b->held)
        PyBuffer_Release(&b->seg);
    b->held = 0;
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static int get_buf(PyObject *o, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "engine: %s must be a contiguous%s buffer", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* run(code, dtype, op, root, send, recv, counts[, nbytes[, mode]]) -> 0 done, 1 pending
 *
 * With nbytes >= 0, recv is the address of that many bytes instead of a buffer object (a
 * torch tensor's data_ptr(): torch tensors do not export buffers); the caller keeps the
 * memory alive until the operation completes or is abandoned. ``mode`` (allreduce):
 * 0 every rank reduces every piece; 1 slices: reduce-scatter + allgather through the
 * slots (each rank reduces 1/n of every piece); 2 in place: the same, reading the peers'
 * buffers with process_vm_readv (one copy; by slices through the slots when some pair
 * cannot). Data larger than a slot moves through the slots in pieces. */
static PyObject *Board_run(Board *b, PyObject *args)
{
    int code, dtype, rop, root;
    PyObject *send, *recv, *counts;
    Py_ssize_t at_bytes = -1;
    int mode = 0;
    if (!PyArg_ParseTuple(args, "iiiiOOO|ni", &code, &dtype, &rop, &root, &send, &recv,
                          &counts, &at_bytes, &mode))
        return NULL;
    if (!b->held) {
        PyErr_SetString(PyExc_RuntimeError, "engine: the board is closed");
        return NULL;
    }
    if (b->stage != 0) {
        PyErr_SetString(PyExc_RuntimeError, "engine: an operation is already in progress");
        return NULL;
    }
    if (code < 0 || code >= OP_COUNT || root < 0 || root >= b->n ||
        pl_itemsize(dtype) == 0) {
        PyErr_SetString(PyExc_ValueError, "engine: bad operation, dtype or root");
        return NULL;
    }
    int reduces = code == OP_ALLREDUCE || code == OP_REDUCE || code == OP_REDUCE_SCATTER;
    if (reduces && !pl_reduce_defined(dtype, rop)) {
        PyErr_SetString(PyExc_TypeError, "engine: reduce op not defined for this dtype");
        return NULL;
    }
    b->code = code;
    b->dtype = dtype;
    b->rop = rop;
    b->root = root;
    b->isz = pl_itemsize(dtype);
    int is_root = b->me == root;
    /* who writes what: buffers that a rank does not use may be None */
    if (send != Py_None) {
        if (get_buf(send, &b->send, 0, "send") < 0)
            goto fail;
        b->has_send = 1;
    }
    /* a rank that only contributes (reduce off the root, broadcast's root) may pass a
     * read-only buffer: it is read, never written */
    int reads_only = (code == OP_REDUCE && !is_root) || (code == OP_BROADCAST && is_root);
    if (at_bytes >= 0) {
        void *addr = PyLong_AsVoidPtr(recv);
        if (addr == NULL && (PyErr_Occurred() || at_bytes > 0)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "engine: null address");
            goto fail;
        }
        /* no owner object: releasing this view is a no-op */
        PyBuffer_FillInfo(&b->recv, NULL, addr, at_bytes, reads_only, PyBUF_SIMPLE);
        b->has_recv = 1;
    } else if (recv != Py_None) {
        if (get_buf(recv, &b->recv, !reads_only, "recv") < 0)
            goto fail;
        b->has_recv = 1;
    }
    size_t n = (size_t)b->n;
    size_t block = 0;  /* the largest block of one rank that pieces cut up */
    int packed = 0;    /* each piece packs n sub-blocks into a slot */
    switch (code) {
    case OP_ALLREDUCE:
    case OP_REDUCE:
    case OP_BROADCAST:
        if (!b->has_recv) {
            PyErr_SetString(PyExc_TypeError, "engine: the operation needs its buffer");
            goto fail;
        }
        block = (size_t)b->recv.len;
        break;
    case OP_ALLGATHERV: {
        if (!b->has_send || !b->has_recv)
            goto need_both;
        if (!PyTuple_Check(counts) || PyTuple_GET_SIZE(counts) != b->n) {
            PyErr_SetString(PyExc_ValueError, "engine: allgatherv needs n counts");
            goto fail;
        }
        b->counts = PyMem_Malloc(sizeof(Py_ssize_t) * n);
        if (b->counts == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        size_t total = 0;
        for (size_t k = 0; k < n; k++) {
            Py_ssize_t c = PyLong_AsSsize_t(PyTuple_GET_ITEM(counts, k));
            if ((size_t)c * b->isz > block)
                block = (size_t)c * b->isz;
            if (c < 0) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "engine: negative count");
                goto fail;
            }
            b->counts[k] = c;
            total += (size_t)c * b->isz;
        }
        if ((size_t)b->send.len != (size_t)b->counts[b->me] * b->isz ||
            (size_t)b->recv.len < total) {
            PyErr_SetString(PyExc_ValueError, "engine: allgatherv buffers disagree with counts");
            goto fail;
        }
        break;
    }
    case OP_GATHER:
        if (!b->has_send || (is_root && !b->has_recv))
            goto need_both;
        if (is_root && (size_t)b->recv.len < n * (size_t)b->send.len) {
            PyErr_SetString(PyExc_ValueError, "engine: gather's receive buffer is too small");
            goto fail;
        }
        block = (size_t)b->send.len;
        break;
    case OP_SCATTER:
        if (!b->has_recv || (is_root && !b->has_send))
            goto need_both;
        if (is_root && (size_t)b->send.len < n * (size_t)b->recv.len) {
            PyErr_SetString(PyExc_ValueError, "engine: scatter's send buffer is too small");
            goto fail;
        }
        block = (size_t)b->recv.len;
        packed = 1;
        break;
    case OP_REDUCE_SCATTER:
    case OP_ALLTOALL:
        if (!b->has_send || !b->has_recv)
            goto need_both;
        /* reduce_scatter: n blocks in, one out; alltoall: n blocks each way */
        if ((code == OP_REDUCE_SCATTER ? (size_t)b->send.len != n * (size_t)b->recv.len
                                       : (b->send.len != b->recv.len || b->recv.len % b->n)) ||
            (size_t)b->recv.len % b->isz) {
            PyErr_SetString(PyExc_ValueError,
                            "engine: send and receive buffers disagree in size");
            goto fail;
        }
        block = code == OP_ALLTOALL ? (size_t)b->recv.len / n : (size_t)b->recv.len;
        packed = 1;
        break;
    default:
        break;
    }
    if (code == OP_REDUCE)
        b->needs = is_root ? -1 : -2;
    else if (code == OP_GATHER)
        b->needs = is_root ? -1 : -2;
    else if (code == OP_BROADCAST || code == OP_SCATTER)
        b->needs = is_root ? -2 : root;
    else
        b->needs = -1;
    /* pieces: whole elements, and n of them fit one slot where they are packed */
    b->step = (packed ? b->slot_size / n : b->slot_size) / b->isz * b->isz;
    if (b->step == 0) {
        PyErr_SetString(PyExc_ValueError, "engine: the slot is too small for this operation");
        goto fail;
    }
    b->slices = mode == MODE_SLICES && code == OP_ALLREDUCE && b->n > 1;
    b->inplace = mode == MODE_INPLACE && code != OP_BARRIER && b->n > 1 && b->n <= 62;
    b->err = 0;
    if (b->inplace && b->scratch == NULL) {
        b->scratch = PyMem_Malloc((size_t)(b->n - 1) * CMA_CHUNK);
        if (b->scratch == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
    }
    if (b->inplace && b->cma_mask == 0)
        b->cma_mask = cma_probe(b);
    /* in place, every rank waits for every arrival, rooted operations too: whether to
     * fall back to the slots is decided from the words all ranks publish before arriving,
     * so each must have seen all of them (and readers' buffers are held until stage 4
     * anyway) */
    if (b->inplace)
        b->needs = -1;
    b->piece = 0;
    b->npieces = block ? (int64_t)((block + b->step - 1) / b->step) : 1;
    /* hold the GIL only for small operations: a large one's copies run without it */
    b->gil = block * (packed ? n : 1) < GIL_OP_BYTES;
    b->seq += 1;
    b->stage = 1;
    int rc = step_op(b);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(rc);
need_both:
    PyErr_SetString(PyExc_TypeError, "engine: the operation is missing a buffer");
fail:
    release_op(b);
    return NULL;
}

static PyObject *Board_resume(Board *b, PyObject *Py_UNUSED(ignored))
{
    if (b->stage == 0)
        return PyLong_FromLong(0);
    int rc = step_op(b);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(rc);
}

/* sleep(timeout_s) -> whether the pending wait's condition now holds */
static PyObject *Board_sleep(Board *b, PyObject *arg)
{
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (b->stage == 0 || ready(b))
        Py_RETURN_TRUE;
    _Atomic int32_t *w = bell(b, b->me);
    atomic_store(&w[1], 1);
    int32_t seen = atomic_load(&w[0]);
    if (!ready(b)) {
        if (timeout < 0)
            timeout = 0;
        struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
        Py_BEGIN_ALLOW_THREADS
        syscall(SYS_futex, (void *)&w[0], FUTEX_WAIT, seen, &ts, NULL, 0);
        Py_END_ALLOW_THREADS
    }
    atomic_store(&w[1], 0);
    return PyBool_FromLong(ready(b));
}

/* waiting() -> (stage, ranks): what the pending wait still waits for
 * (stage 1: ranks that have not finished the piece before last; 2: ranks that have not
 * arrived; 3: ranks that have not reduced their slice) */
static PyObject *Board_waiting(Board *b, PyObject *Py_UNUSED(ignored))
{
    PyObject *ranks = PyList_New(0);
    if (ranks == NULL)
        return NULL;
    for (int k = 0; k < b->n; k++) {
        if (late(b, k)) {
            PyObject *r = PyLong_FromLong(k);
            if (r == NULL || PyList_Append(ranks, r) < 0) {
                Py_XDECREF(r);
                Py_DECREF(ranks);
                return NULL;
            }
            Py_DECREF(r);
        }
    }
    return Py_BuildValue("(iN)", b->stage, ranks);
}

/* abandon(): forget the operation in progress (it failed); releases its buffers */
static PyObject *Board_abandon(Board *b, PyObject *Py_UNUSED(ignored))
{
    release_op(b);
    Py_RETURN_NONE;
}

/* close(): release the segment (and any operation's buffers); idempotent */
static PyObject *Board_close(Board *b, PyObject *Py_UNUSED(ignored))
{
    release_op(b);
    if (b->held)
        PyBuffer_Release(&b->seg);
    b->held = 0;
    Py_RETURN_NONE;
}

/* forbid_single_copy(): this rank says it cannot read its peers' memory, as where
 * process_vm_readv is refused (containers, Yama): "inplace" operations then run through
 * the slots on every rank. For tests of that path on machines where it is allowed. */
static PyObject *Board_forbid_single_copy(Board *b, PyObject *Py_UNUSED(ignored))
{
    b->cma_mask = CMA_COMPUTED | (1LL << b->me);
    Py_RETURN_NONE;
}

static PyObject *Board_get_seq(Board *b, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(b->seq);
}

static PyObject *Board_get_fallbacks(Board *b, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(b->fallbacks);
}

static PyObject *Board_get_pending(Board *b, void *Py_UNUSED(c))
{
    return PyBool_FromLong(b->stage != 0);
}

static PyMethodDef Board_methods[] = {
    {"run", (PyCFunction)Board_run, METH_VARARGS,
     "run(code, dtype, op, root, send, recv, counts) -> 0 done, 1 a wait is pending"},
    {"resume", (PyCFunction)Board_resume, METH_NOARGS,
     "continue the pending operation: 0 done, 1 still waiting"},
    {"sleep", (PyCFunction)Board_sleep, METH_O,
     "sleep(timeout_s) on this rank's doorbell; True once the pending wait can go on"},
    {"waiting", (PyCFunction)Board_waiting, METH_NOARGS,
     "(stage, ranks) the pending wait waits for"},
    {"abandon", (PyCFunction)Board_abandon, METH_NOARGS, "drop the failed operation"},
    {"close", (PyCFunction)Board_close, METH_NOARGS, "release the segment"},
    {"forbid_single_copy", (PyCFunction)Board_forbid_single_copy, METH_NOARGS,
     "act as if process_vm_readv were refused (tests)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Board_getset[] = {
    {"seq", (getter)Board_get_seq, NULL, "last sequence number begun", NULL},
    {"pending", (getter)Board_get_pending, NULL, "an operation waits to be resumed", NULL},
    {"fallbacks", (getter)Board_get_fallbacks, NULL,
     "in-place operations that went through the slots (some pair could not read)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BoardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "plait.transport._engine.Board",
    .tp_basicsize = sizeof(Board),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The direct collectives over one host segment's slots.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Board_init,
    .tp_dealloc = (destructor)Board_dealloc,
    .tp_methods = Board_methods,
    .tp_getset = Board_getset,
};

/* -- module functions ----------------------------------------------------------------- */

/* reduce(dst, src, dtype, op): dst = dst op src, element-wise, in place */
static PyObject *engine_reduce(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *dst_o, *src_o;
    int dtype, rop;
    if (!PyArg_ParseTuple(args, "OOii", &dst_o, &src_o, &dtype, &rop))
        return NULL;
    if (!pl_reduce_defined(dtype, rop)) {
        PyErr_SetString(PyExc_TypeError, "engine: reduce op not defined for this dtype");
        return NULL;
    }
    Py_buffer dst, src;
    if (get_buf(dst_o, &dst, 1, "dst") < 0)
        return NULL;
    if (get_buf(src_o, &src, 0, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *res = NULL;
    size_t isz = pl_itemsize(dtype);
    if (dst.len != src.len || (size_t)dst.len % isz) {
        PyErr_SetString(PyExc_ValueError, "engine: reduce needs equal whole buffers");
    } else {
        const void *rows[2] = {dst.buf, src.buf};
        size_t count = (size_t)dst.len / isz;
        if ((size_t)dst.len >= GIL_FREE_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            pl_reduce_rows(dtype, rop, dst.buf, rows, 2, count);
            Py_END_ALLOW_THREADS
        } else {
            pl_reduce_rows(dtype, rop, dst.buf, rows, 2, count);
        }
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return res;
}

static PyMethodDef engine_methods[] = {
    {"reduce", engine_reduce, METH_VARARGS,
     "reduce(dst, src, dtype, op): dst = dst op src in place"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef engine_module = {
    PyModuleDef_HEAD_INIT, "plait.transport._engine",
    "plait's compiled shared-memory data path.", -1, engine_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__engine(void)
{
    if (PyType_Ready(&BoardType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&engine_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BoardType);
    if (PyModule_AddObject(m, "Board", (PyObject *)&BoardType) < 0) {
        Py_DECREF(&BoardType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "CTL_WORDS", CTL_WORDS) < 0 ||
        PyModule_AddIntConstant(m, "OP_COUNT", OP_COUNT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
