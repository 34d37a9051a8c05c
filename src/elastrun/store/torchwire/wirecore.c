/*
 * The workers' store served from C: torch's TCPStore protocol on an epoll loop of its
 * own, with no Python per request.
 *
 * The Python engine (connection.py, state.py) is the definition of what is served; this
 * file is the same rules written for speed, and the contract tests run both against
 * torch's own server. A Python thread calls Core.serve(), which gives up the GIL for as
 * long as it serves and takes it back only to hand a complaint about a misbehaving
 * client to Python's logging. Core.stop() (any thread) ends it through an eventfd.
 *
 * One thread owns everything below: no locks. The counters Python reads from other
 * threads (keys, connections) are read and written atomically.
 *
 * Who may connect follows the rendezvous store's acceptor (elastrun.store.tcp.acceptor,
 * which accepts for the Python engine), with the numbers it computes: connections that
 * have not validated yet are capped, the oldest one closed to make room once it has had
 * its time to validate (at the cap, and at the descriptor reserve), and accepting pauses
 * -- the others wait in the listen backlog -- while the cap is full of younger ones or no
 * more than a reserve of descriptors is free.
 *
 * Linux only (epoll, eventfd, accept4); elsewhere the Python engine serves.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum {
    OP_VALIDATE = 0, OP_SET, OP_COMPARE_SET, OP_GET, OP_ADD, OP_CHECK, OP_WAIT,
    OP_GETNUMKEYS, OP_DELETE_KEY, OP_APPEND, OP_MULTI_GET, OP_MULTI_SET,
    OP_CANCEL_WAIT, OP_PING, OP_QUEUE_PUSH, OP_QUEUE_POP, OP_QUEUE_LEN, OP_LIST_KEYS,
    OP_BARRIER, OP_COUNT
};

static const char *const OP_NAMES[OP_COUNT] = {
    "VALIDATE", "SET", "COMPARE_SET", "GET", "ADD", "CHECK", "WAIT", "GETNUMKEYS",
    "DELETE_KEY", "APPEND", "MULTI_GET", "MULTI_SET", "CANCEL_WAIT", "PING",
    "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN", "LIST_KEYS", "BARRIER",
};

#define MAGIC 0x3C85F7CEu
#define MAX_KEYS_PER_REQUEST (128 * 1024)
#define STOP_WAITING 0
#define WAIT_CANCELED 1
/* Unsent answers past which a connection is not read until the peer reads them. */
#define OUT_HIGH (256 * 1024)
#define READ_CHUNK (64 * 1024)
#define MAX_EVENTS 256
/* Connections taken per wake-up (the cap on those not validated yet may stop it first;
   they wait for the next wake-up, their validations read in between). */
#define ACCEPT_BATCH 1024

/* -- buffers ------------------------------------------------------------------------- */

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_reserve(Buf *b, size_t extra) {
    if (b->len + extra <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra)
        cap *= 2;
    char *data = realloc(b->data, cap);
    if (data == NULL)
        return -1;
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const void *data, size_t size) {
    if (buf_reserve(b, size) < 0)
        return -1;
    if (size)
        memcpy(b->data + b->len, data, size);
    b->len += size;
    return 0;
}

static int buf_u64(Buf *b, uint64_t n) { return buf_put(b, &n, 8); }

static int buf_blob(Buf *b, const char *data, size_t size) {
    return buf_reserve(b, size + 8) < 0 ? -1 : (buf_u64(b, size), buf_put(b, data, size));
}

static void buf_free(Buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* -- the table ----------------------------------------------------------------------- */

struct Waiter;

typedef struct Link { /* one waiter's stake in one key it misses */
    struct Waiter *waiter;
    struct Entry *entry;
    struct Link *prev, *next; /* the entry's waiters, in arrival order */
} Link;

typedef struct Item {
    struct Item *next;
    size_t len;
    char data[];
} Item;

typedef struct Entry { /* everything about one key: value, queue, waiters */
    uint64_t hash;
    char *key;
    size_t key_len;
    char *value; /* NULL: no value (a queue's or a waiter's key only) */
    size_t value_len;
    Item *queue_head, *queue_tail;
    size_t queue_len;
    Link *first, *last;
    uint64_t mark; /* the last wait that looked at it: keys named twice count once */
} Entry;

typedef struct {
    Entry **slots; /* open addressing, linear probing, no tombstones */
    size_t cap, used;
} Table;

typedef struct Waiter {
    struct Conn *conn;
    int barrier;
    size_t missing;
    Link *links;
    size_t nlinks;
} Waiter;

static uint64_t hash_key(const char *key, size_t len) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then mixed */
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)key[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static size_t table_find(const Table *t, const char *key, size_t len, uint64_t h) {
    size_t mask = t->cap - 1, i = h & mask;
    for (;;) {
        Entry *e = t->slots[i];
        if (e == NULL || (e->hash == h && e->key_len == len && memcmp(e->key, key, len) == 0))
            return i;
        i = (i + 1) & mask;
    }
}

static int table_grow(Table *t) {
    size_t cap = t->cap ? t->cap * 2 : 1024;
    Entry **slots = calloc(cap, sizeof(Entry *));
    if (slots == NULL)
        return -1;
    for (size_t i = 0; i < t->cap; i++) {
        Entry *e = t->slots[i];
        if (e == NULL)
            continue;
        size_t j = e->hash & (cap - 1);
        while (slots[j] != NULL)
            j = (j + 1) & (cap - 1);
        slots[j] = e;
    }
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
    return 0;
}

static Entry *table_get(const Table *t, const char *key, size_t len) {
    if (t->cap == 0)
        return NULL;
    return t->slots[table_find(t, key, len, hash_key(key, len))];
}

/* The key's entry, made when missing; NULL when out of memory. */
static Entry *table_add(Table *t, const char *key, size_t len) {
    if ((t->used + 1) * 4 > t->cap * 3 && table_grow(t) < 0)
        return NULL;
    uint64_t h = hash_key(key, len);
    size_t i = table_find(t, key, len, h);
    if (t->slots[i] != NULL)
        return t->slots[i];
    Entry *e = calloc(1, sizeof(Entry));
    if (e == NULL)
        return NULL;
    e->key = malloc(len ? len : 1);
    if (e->key == NULL) {
        free(e);
        return NULL;
    }
    memcpy(e->key, key, len);
    e->key_len = len;
    e->hash = h;
    t->slots[i] = e;
    t->used++;
    return e;
}

static void table_remove(Table *t, Entry *e) {
    size_t mask = t->cap - 1, i = table_find(t, e->key, e->key_len, e->hash);
    t->slots[i] = NULL;
    t->used--;
    /* Backward shift: move up every later entry of the run that may sit at i. */
    for (size_t j = (i + 1) & mask; t->slots[j] != NULL; j = (j + 1) & mask) {
        size_t home = t->slots[j]->hash & mask;
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            t->slots[i] = t->slots[j];
            t->slots[j] = NULL;
            i = j;
        }
    }
}

static void entry_free(Entry *e) {
    for (Item *it = e->queue_head, *next; it != NULL; it = next) {
        next = it->next;
        free(it);
    }
    free(e->value);
    free(e->key);
    free(e);
}

/* -- connections and the core -------------------------------------------------------- */

typedef struct Conn {
    int fd;
    int validated, closed, paused, pending;
    int64_t since_ms; /* when it was accepted */
    uint32_t events;  /* what epoll watches for it now */
    Buf in;
    size_t in_start;  /* where the next request starts in `in` */
    size_t in_need;   /* bytes `in` must hold before a parse can succeed */
    Buf out;
    size_t out_sent;
    Waiter *waiter;
    struct Conn *prev, *next;   /* every live connection */
    struct Conn *hs_prev, *hs_next; /* the ones not validated yet, oldest first */
    struct Conn *next_pending;  /* connections with answers to write after this event */
    struct Conn *next_dead;     /* closed, freed after this batch of events */
} Conn;

typedef struct {
    PyObject_HEAD
    int epfd, stopfd;
    int *listeners;
    Py_ssize_t nlisteners;
    size_t max_connections, max_frame, max_key;
    PyObject *complain, *notice;
    PyThreadState *gil; /* while serving: the state saved when the GIL was given up */
    Table table;
    size_t num_keys, num_connections; /* atomics: read from other threads */
    uint64_t wait_stamp;
    Conn *conns, *pending, *dead;
    int ready, served;
    /* Admission (see the top of this file): the numbers are the Python acceptor's. */
    Conn *hs_first, *hs_last; /* not validated yet, oldest first */
    size_t handshakes, max_handshakes;
    uint64_t unvalidated_closed;
    int64_t fd_limit, fd_reserve, evict_after_ms, recheck_ms, recount_ms;
    int accepting; /* the listeners are in the epoll set */
    int room;      /* a connection ended or validated since the loop last looked */
    int64_t retry_ms; /* while not accepting: look again then (0: not set) */
    int64_t counted_ms, counted_fds; /* the last count of open descriptors, */
    size_t counted_conns;            /* and of connections then */
    char why[256]; /* the current request's protocol error */
} Core;

#define STOP_TAG ((void *)1)
#define LISTEN_TAG_BASE 2 /* listener i is tagged LISTEN_TAG_BASE + i */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void set_count(size_t *counter, size_t value) {
    __atomic_store_n(counter, value, __ATOMIC_RELAXED);
}

static void complain(Core *core, Conn *conn, const char *format, const char *detail) {
    char peer[INET6_ADDRSTRLEN + 16] = "?";
    struct sockaddr_storage addr;
    socklen_t size = sizeof addr;
    if (conn != NULL && getpeername(conn->fd, (struct sockaddr *)&addr, &size) == 0) {
        char host[INET6_ADDRSTRLEN];
        if (addr.ss_family == AF_INET) {
            struct sockaddr_in *a = (struct sockaddr_in *)&addr;
            inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
            snprintf(peer, sizeof peer, "%s:%u", host, ntohs(a->sin_port));
        } else if (addr.ss_family == AF_INET6) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)&addr;
            inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
            snprintf(peer, sizeof peer, "[%s]:%u", host, ntohs(a->sin6_port));
        }
    }
    char message[512];
    snprintf(message, sizeof message, format, peer, detail);
    if (core->gil != NULL)
        PyEval_RestoreThread(core->gil);
    PyObject *result = PyObject_CallFunction(core->complain, "s", message);
    if (result == NULL)
        PyErr_WriteUnraisable(core->complain);
    Py_XDECREF(result);
    if (core->gil != NULL)
        core->gil = PyEval_SaveThread();
}

/* Tell Python that accepting paused or resumed (`kind`: why, or "resume"). */
static void notice(Core *core, const char *kind, const char *message) {
    if (core->gil != NULL)
        PyEval_RestoreThread(core->gil);
    PyObject *result = PyObject_CallFunction(core->notice, "ss", kind, message);
    if (result == NULL)
        PyErr_WriteUnraisable(core->notice);
    Py_XDECREF(result);
    if (core->gil != NULL)
        core->gil = PyEval_SaveThread();
}

/* A connection leaves the ones not validated yet (validated, or closed). */
static void hs_unlink(Core *core, Conn *conn) {
    if (conn->validated)
        return;
    if (conn->hs_prev)
        conn->hs_prev->hs_next = conn->hs_next;
    else
        core->hs_first = conn->hs_next;
    if (conn->hs_next)
        conn->hs_next->hs_prev = conn->hs_prev;
    else
        core->hs_last = conn->hs_prev;
    conn->hs_prev = conn->hs_next = NULL;
    core->handshakes--;
    core->room = 1;
}

static void drop_waiter(Core *core, Conn *conn);

/* Close at once: answers not yet handed to the kernel are dropped.

   The socket leaves the epoll set before it is closed. epoll forgets a socket on its
   own only once every descriptor of it is closed, and a process forked from this one
   (a function worker started with fork) keeps its copies: the set would go on
   reporting the socket, with this connection's freed memory as its data. */
static void conn_close(Core *core, Conn *conn) {
    if (conn->closed)
        return;
    conn->closed = 1;
    drop_waiter(core, conn);
    hs_unlink(core, conn);
    conn->validated = 1; /* (out of the list for good) */
    core->room = 1;
    epoll_ctl(core->epfd, EPOLL_CTL_DEL, conn->fd, NULL);
    close(conn->fd);
    if (conn->prev)
        conn->prev->next = conn->next;
    else
        core->conns = conn->next;
    if (conn->next)
        conn->next->prev = conn->prev;
    conn->next_dead = core->dead;
    core->dead = conn;
    set_count(&core->num_connections, core->num_connections - 1);
}

static void bury(Core *core) {
    while (core->dead != NULL) {
        Conn *conn = core->dead;
        core->dead = conn->next_dead;
        buf_free(&conn->in);
        buf_free(&conn->out);
        free(conn);
    }
}

/* -- waiting ------------------------------------------------------------------------- */

static int entry_there(const Entry *e) { return e != NULL && (e->value != NULL || e->queue_len); }

static void maybe_drop(Core *core, Entry *e) {
    if (e->value == NULL && e->queue_len == 0 && e->first == NULL) {
        table_remove(&core->table, e);
        entry_free(e);
    }
}

static void unlink_from(Link *l) {
    Entry *e = l->entry;
    if (l->prev)
        l->prev->next = l->next;
    else
        e->first = l->next;
    if (l->next)
        l->next->prev = l->prev;
    else
        e->last = l->prev;
    l->entry = NULL;
}

static void answer_byte(Core *core, Conn *conn, unsigned char byte);

static void waiter_free(Waiter *w) {
    free(w->links);
    free(w);
}

/* `l`'s key is there for its waiter; returns 1 when that released the waiter. */
static int satisfy(Core *core, Link *l) {
    Waiter *w = l->waiter;
    unlink_from(l);
    if (--w->missing)
        return 0;
    Conn *conn = w->conn;
    conn->waiter = NULL;
    waiter_free(w);
    answer_byte(core, conn, STOP_WAITING);
    return 1;
}

/* Release the key's waiters (barriers too when `barriers`). The entry stays: its
   caller holds it, and drops it when it may be empty. */
static void release(Core *core, Entry *e, int barriers) {
    for (Link *l = e->first, *next; l != NULL; l = next) {
        next = l->next;
        if (barriers || !l->waiter->barrier)
            satisfy(core, l);
    }
}

/* One pushed item: it counts for plain waiters in arrival order until one of them has
   nothing left to wait for. */
static void release_one(Core *core, Entry *e) {
    for (Link *l = e->first, *next; l != NULL; l = next) {
        next = l->next;
        if (!l->waiter->barrier && satisfy(core, l))
            return;
    }
}

static void drop_waiter(Core *core, Conn *conn) {
    Waiter *w = conn->waiter;
    if (w == NULL)
        return;
    conn->waiter = NULL;
    for (size_t i = 0; i < w->nlinks; i++) {
        Entry *e = w->links[i].entry;
        if (e != NULL) {
            unlink_from(&w->links[i]);
            maybe_drop(core, e);
        }
    }
    waiter_free(w);
}

/* -- answers ------------------------------------------------------------------------- */

static void schedule(Core *core, Conn *conn) {
    if (!conn->pending && !conn->closed) {
        conn->pending = 1;
        conn->next_pending = core->pending;
        core->pending = conn;
    }
}

static int out_fail(Core *core, Conn *conn) {
    complain(core, conn, "closing the connection from %s: %s", "out of memory");
    conn_close(core, conn);
    return -1;
}

static void answer_byte(Core *core, Conn *conn, unsigned char byte) {
    if (buf_put(&conn->out, &byte, 1) < 0)
        out_fail(core, conn);
    schedule(core, conn);
}

static int answer_i64(Core *core, Conn *conn, int64_t n) {
    return buf_put(&conn->out, &n, 8) < 0 ? out_fail(core, conn) : 0;
}

static int answer_blob(Core *core, Conn *conn, const char *data, size_t size) {
    return buf_blob(&conn->out, data, size) < 0 ? out_fail(core, conn) : 0;
}

static void update_events(Core *core, Conn *conn) {
    uint32_t want = (conn->paused ? 0 : EPOLLIN) | (conn->out.len > conn->out_sent ? EPOLLOUT : 0);
    if (want != conn->events) {
        struct epoll_event ev = {.events = want, .data.ptr = conn};
        if (epoll_ctl(core->epfd, EPOLL_CTL_MOD, conn->fd, &ev) == 0)
            conn->events = want;
    }
}

/* Write what is unsent, as far as the kernel takes it. -1: the connection closed. */
static int flush(Core *core, Conn *conn) {
    while (conn->out_sent < conn->out.len) {
        ssize_t n = send(conn->fd, conn->out.data + conn->out_sent,
                         conn->out.len - conn->out_sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            conn_close(core, conn);
            return -1;
        }
        conn->out_sent += (size_t)n;
    }
    if (conn->out_sent == conn->out.len) {
        conn->out.len = conn->out_sent = 0;
        if (conn->out.cap > 4 * OUT_HIGH) { /* a large answer went: give its memory back */
            buf_free(&conn->out);
        }
    }
    return 0;
}

/* -- requests ------------------------------------------------------------------------ */

typedef struct {
    const char *p;
    size_t len;
} Span;

typedef struct {
    int op;
    uint64_t number; /* magic, nonce, amount, world size (as read) */
    Span key, v1, v2;
    size_t count;       /* keys of CHECK/WAIT/MULTI_GET/MULTI_SET */
    const char *fields; /* where those keys (and values) start */
} Request;

static uint64_t read_u64(const char *p) {
    uint64_t n;
    memcpy(&n, p, 8);
    return n;
}

/* Parse one request at `p` (n bytes held). Returns its size, 0 when more bytes are
   needed (and sets *need to the least the request can take, when known), or -1 for a
   protocol error (core->why says which). Limits are checked as soon as a length is
   read, before the bytes it announces arrive. */
static ssize_t parse(Core *core, const char *p, size_t n, Request *r, size_t *need) {
    size_t at = 1, frame = core->max_frame;
    *need = 0;
#define NEED(size, what)                                                                 \
    do {                                                                                 \
        if (at + (size) > frame) {                                                       \
            snprintf(core->why, sizeof core->why,                                        \
                     "%s of %llu bytes exceeds the request size limit", what,            \
                     (unsigned long long)(size));                                        \
            return -1;                                                                   \
        }                                                                                \
        if (at + (size) > n) {                                                           \
            *need = at + (size);                                                         \
            return 0;                                                                    \
        }                                                                                \
    } while (0)
#define BLOB(span, limit, what)                                                          \
    do {                                                                                 \
        NEED(8, "header");                                                               \
        uint64_t size_ = read_u64(p + at);                                               \
        if (size_ > (limit)) {                                                           \
            snprintf(core->why, sizeof core->why,                                        \
                     "%s of %llu bytes exceeds the %zu-byte limit", what,                \
                     (unsigned long long)size_, (size_t)(limit));                        \
            return -1;                                                                   \
        }                                                                                \
        at += 8;                                                                         \
        NEED(size_, what);                                                               \
        (span).p = p + at;                                                               \
        (span).len = size_;                                                              \
        at += size_;                                                                     \
    } while (0)
    int op = (unsigned char)p[0];
    r->op = op;
    r->count = 0;
    if (op >= OP_COUNT) {
        snprintf(core->why, sizeof core->why, "unknown command byte %d", op);
        return -1;
    }
    Span skip;
    switch (op) {
    case OP_VALIDATE:
    case OP_PING: {
        NEED(4, "header");
        uint32_t v;
        memcpy(&v, p + at, 4);
        r->number = v;
        at += 4;
        break;
    }
    case OP_GETNUMKEYS:
    case OP_CANCEL_WAIT:
    case OP_LIST_KEYS:
        break;
    case OP_GET:
    case OP_DELETE_KEY:
    case OP_QUEUE_POP:
    case OP_QUEUE_LEN:
        BLOB(r->key, core->max_key, "key");
        break;
    case OP_SET:
    case OP_APPEND:
    case OP_QUEUE_PUSH:
        BLOB(r->key, core->max_key, "key");
        BLOB(r->v1, frame, "value");
        break;
    case OP_COMPARE_SET:
        BLOB(r->key, core->max_key, "key");
        BLOB(r->v1, frame, "value");
        BLOB(r->v2, frame, "value");
        break;
    case OP_ADD:
    case OP_BARRIER:
        BLOB(r->key, core->max_key, "key");
        NEED(8, "header");
        r->number = read_u64(p + at);
        at += 8;
        break;
    default: { /* CHECK, WAIT, MULTI_GET; MULTI_SET (its count signed) */
        NEED(8, "header");
        uint64_t count = read_u64(p + at);
        if ((op == OP_MULTI_SET && (int64_t)count < 0) || count > MAX_KEYS_PER_REQUEST) {
            if (op == OP_MULTI_SET) /* its count is sent signed */
                snprintf(core->why, sizeof core->why, "a request naming %lld keys (at most %d)",
                         (long long)(int64_t)count, MAX_KEYS_PER_REQUEST);
            else
                snprintf(core->why, sizeof core->why, "a request naming %llu keys (at most %d)",
                         (unsigned long long)count, MAX_KEYS_PER_REQUEST);
            return -1;
        }
        at += 8;
        r->count = (size_t)count;
        r->fields = p + at;
        for (uint64_t i = 0; i < count; i++) {
            BLOB(skip, core->max_key, "key");
            if (op == OP_MULTI_SET)
                BLOB(skip, frame, "value");
        }
        break;
    }
    }
    (void)skip;
    return (ssize_t)at;
#undef NEED
#undef BLOB
}

/* The i-th blob of an already parsed list, advancing *cursor. */
static Span next_blob(const char **cursor) {
    Span s;
    s.len = read_u64(*cursor);
    s.p = *cursor + 8;
    *cursor += 8 + s.len;
    return s;
}

/* At most 40 bytes of a value as Python's repr shows them (b'...'), into out[200]. */
static void show_bytes(const char *data, size_t size, char *out) {
    size_t at = 0;
    out[at++] = 'b';
    out[at++] = '\'';
    for (size_t i = 0; i < size && i < 40; i++) {
        unsigned char ch = (unsigned char)data[i];
        if (ch == '\\' || ch == '\'')
            at += (size_t)sprintf(out + at, "\\%c", ch);
        else if (ch == '\n')
            at += (size_t)sprintf(out + at, "\\n");
        else if (ch == '\t')
            at += (size_t)sprintf(out + at, "\\t");
        else if (ch == '\r')
            at += (size_t)sprintf(out + at, "\\r");
        else if (ch >= 32 && ch < 127)
            out[at++] = (char)ch;
        else
            at += (size_t)sprintf(out + at, "\\x%02x", ch);
    }
    out[at++] = '\'';
    out[at] = 0;
}

/* std::stoll's reading of a counter: white space, a sign, digits, the rest ignored.
   Returns 0 and sets *out, or -1 with core->why set. */
static int read_counter(Core *core, const Entry *e, int64_t *out) {
    *out = 0;
    if (e == NULL || e->value == NULL)
        return 0;
    const char *p = e->value, *end = e->value + e->value_len;
    while (p < end && (*p == ' ' || (*p >= '\t' && *p <= '\r')))
        p++;
    int negative = 0;
    if (p < end && (*p == '+' || *p == '-'))
        negative = *p++ == '-';
    if (p >= end || *p < '0' || *p > '9') {
        char shown[200];
        show_bytes(e->value, e->value_len, shown);
        snprintf(core->why, sizeof core->why, "the value %s is not a number", shown);
        return -1;
    }
    uint64_t magnitude = 0, limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; p < end && *p >= '0' && *p <= '9'; p++) {
        unsigned digit = (unsigned)(*p - '0');
        if (magnitude > (limit - digit) / 10) {
            char shown[200];
            show_bytes(e->value, e->value_len, shown);
            snprintf(core->why, sizeof core->why, "the value %s does not fit in 64 bits", shown);
            return -1;
        }
        magnitude = magnitude * 10 + digit;
    }
    *out = negative ? (int64_t)(0 - magnitude) : (int64_t)magnitude;
    return 0;
}

static int store_value(Entry *e, const char *data, size_t size) {
    char *copy = malloc(size ? size : 1);
    if (copy == NULL)
        return -1;
    memcpy(copy, data, size);
    free(e->value);
    e->value = copy;
    e->value_len = size;
    return 0;
}

static void count_keys(Core *core, int delta) {
    set_count(&core->num_keys, core->num_keys + (size_t)(ssize_t)delta);
}

/* Set `key` to the value and release its waiters; -1: out of memory. */
static int do_set(Core *core, Span key, const char *data, size_t size) {
    Entry *e = table_add(&core->table, key.p, key.len);
    if (e == NULL)
        return -1;
    int had = e->value != NULL;
    if (store_value(e, data, size) < 0) {
        maybe_drop(core, e);
        return -1;
    }
    if (!had)
        count_keys(core, 1);
    release(core, e, 1);
    return 0;
}

static int store_counter(Core *core, Entry *e, int64_t n) {
    char digits[24];
    int size = snprintf(digits, sizeof digits, "%lld", (long long)n);
    int had = e->value != NULL;
    if (store_value(e, digits, (size_t)size) < 0)
        return -1;
    if (!had)
        count_keys(core, 1);
    return 0;
}

#define FAIL_MEMORY()                                                                    \
    do {                                                                                 \
        snprintf(core->why, sizeof core->why, "out of memory");                          \
        return -1;                                                                       \
    } while (0)

/* Block `conn` until every key of the list is there; the answer is written when they
   are (now, when they already are). */
static int do_wait(Core *core, Conn *conn, const Request *r, int barrier_entry_only,
                   Entry *barrier_entry) {
    Waiter *w = calloc(1, sizeof(Waiter));
    if (w == NULL)
        FAIL_MEMORY();
    w->conn = conn;
    w->barrier = barrier_entry_only;
    size_t n = barrier_entry_only ? 1 : r->count;
    w->links = calloc(n ? n : 1, sizeof(Link));
    if (w->links == NULL) {
        free(w);
        FAIL_MEMORY();
    }
    uint64_t stamp = ++core->wait_stamp;
    const char *cursor = r->fields;
    for (size_t i = 0; i < n; i++) {
        Entry *e = barrier_entry;
        if (!barrier_entry_only) {
            Span key = next_blob(&cursor);
            e = table_get(&core->table, key.p, key.len);
            if (entry_there(e))
                continue;
            if (e == NULL && (e = table_add(&core->table, key.p, key.len)) == NULL) {
                conn->waiter = w; /* so that it is dropped with what it holds */
                FAIL_MEMORY();
            }
        }
        if (e->mark == stamp)
            continue;
        e->mark = stamp;
        Link *l = &w->links[w->nlinks++];
        l->waiter = w;
        l->entry = e;
        l->prev = e->last;
        if (e->last)
            e->last->next = l;
        else
            e->first = l;
        e->last = l;
        w->missing++;
    }
    if (w->missing == 0) {
        waiter_free(w);
        answer_byte(core, conn, STOP_WAITING);
        return 0;
    }
    conn->waiter = w;
    return 0;
}

static int protocol_error(Core *core, const char *format, const char *name) {
    snprintf(core->why, sizeof core->why, format, name);
    return -1;
}

/* Serve one parsed request. -1: close this connection (core->why says why). */
static int serve(Core *core, Conn *conn, const Request *r) {
    Entry *e;
    if (!conn->validated) {
        if (r->op != OP_VALIDATE || r->number != MAGIC) {
            snprintf(core->why, sizeof core->why,
                     "its first request is %s %#llx, not the validation a torch client "
                     "sends (another protocol, or not torch?)",
                     OP_NAMES[r->op], (unsigned long long)r->number);
            return -1;
        }
        hs_unlink(core, conn);
        conn->validated = 1;
        return 0;
    }
    switch (r->op) {
    case OP_VALIDATE:
        return protocol_error(core, "unexpected %s request", "VALIDATE");
    case OP_PING: {
        uint32_t nonce = (uint32_t)r->number;
        return buf_put(&conn->out, &nonce, 4) < 0 ? out_fail(core, conn) : 0;
    }
    case OP_SET:
        return do_set(core, r->key, r->v1.p, r->v1.len) < 0 ? out_fail(core, conn) : 0;
    case OP_GET:
        e = table_get(&core->table, r->key.p, r->key.len);
        if (e == NULL || e->value == NULL)
            return answer_blob(core, conn, "", 0);
        return answer_blob(core, conn, e->value, e->value_len);
    case OP_ADD: {
        e = table_get(&core->table, r->key.p, r->key.len);
        int64_t current;
        if (read_counter(core, e, &current) < 0)
            return -1;
        int64_t total = (int64_t)((uint64_t)current + r->number); /* wraps, as torch */
        if (e == NULL && (e = table_add(&core->table, r->key.p, r->key.len)) == NULL)
            FAIL_MEMORY();
        if (store_counter(core, e, total) < 0)
            FAIL_MEMORY();
        release(core, e, 1);
        return answer_i64(core, conn, total);
    }
    case OP_COMPARE_SET:
        e = table_get(&core->table, r->key.p, r->key.len);
        if (e == NULL || e->value == NULL) {
            if (r->v1.len)
                return answer_blob(core, conn, r->v1.p, r->v1.len);
            if (do_set(core, r->key, r->v2.p, r->v2.len) < 0)
                FAIL_MEMORY();
            return answer_blob(core, conn, r->v2.p, r->v2.len);
        }
        if (e->value_len == r->v1.len && memcmp(e->value, r->v1.p, r->v1.len) == 0 &&
            store_value(e, r->v2.p, r->v2.len) < 0)
            FAIL_MEMORY();
        release(core, e, 1); /* written even when unchanged: it releases the barrier */
        return answer_blob(core, conn, e->value, e->value_len);
    case OP_CHECK: {
        const char *cursor = r->fields;
        int ready = 1;
        for (size_t i = 0; i < r->count && ready; i++) {
            Span key = next_blob(&cursor);
            ready = entry_there(table_get(&core->table, key.p, key.len));
        }
        answer_byte(core, conn, ready ? 0 : 1);
        return 0;
    }
    case OP_WAIT:
        if (conn->waiter != NULL)
            return protocol_error(core, "%s while its previous wait is still blocked", "WAIT");
        return do_wait(core, conn, r, 0, NULL);
    case OP_BARRIER: {
        if (conn->waiter != NULL)
            return protocol_error(core, "%s while its previous wait is still blocked",
                                  "BARRIER");
        e = table_get(&core->table, r->key.p, r->key.len);
        int64_t count;
        if (read_counter(core, e, &count) < 0)
            return -1;
        count = (int64_t)((uint64_t)count + 1);
        if (e == NULL && (e = table_add(&core->table, r->key.p, r->key.len)) == NULL)
            FAIL_MEMORY();
        if (store_counter(core, e, count) < 0)
            FAIL_MEMORY();
        if (count >= (int64_t)r->number) {
            release(core, e, 1);
            answer_byte(core, conn, STOP_WAITING);
            return 0;
        }
        release(core, e, 0); /* the key exists now: plain waiters on it are done */
        return do_wait(core, conn, r, 1, e);
    }
    case OP_GETNUMKEYS:
        return answer_i64(core, conn, (int64_t)core->num_keys);
    case OP_DELETE_KEY: {
        e = table_get(&core->table, r->key.p, r->key.len);
        int had = e != NULL && e->value != NULL;
        if (had) {
            free(e->value);
            e->value = NULL;
            e->value_len = 0;
            count_keys(core, -1);
            maybe_drop(core, e);
        }
        return answer_i64(core, conn, had);
    }
    case OP_APPEND: {
        e = table_get(&core->table, r->key.p, r->key.len);
        if (e == NULL || e->value == NULL)
            return do_set(core, r->key, r->v1.p, r->v1.len) < 0 ? out_fail(core, conn) : 0;
        char *joined = realloc(e->value, e->value_len + r->v1.len + 1);
        if (joined == NULL)
            FAIL_MEMORY();
        memcpy(joined + e->value_len, r->v1.p, r->v1.len);
        e->value = joined;
        e->value_len += r->v1.len;
        release(core, e, 1);
        return 0;
    }
    case OP_MULTI_GET: {
        const char *cursor = r->fields;
        for (size_t i = 0; i < r->count; i++) {
            Span key = next_blob(&cursor);
            e = table_get(&core->table, key.p, key.len);
            int failed = e == NULL || e->value == NULL
                             ? answer_blob(core, conn, "", 0)
                             : answer_blob(core, conn, e->value, e->value_len);
            if (failed)
                return -1;
        }
        return 0;
    }
    case OP_MULTI_SET: {
        const char *cursor = r->fields;
        for (size_t i = 0; i < r->count; i++) {
            Span key = next_blob(&cursor), value = next_blob(&cursor);
            if (do_set(core, key, value.p, value.len) < 0)
                FAIL_MEMORY();
        }
        return 0;
    }
    case OP_CANCEL_WAIT:
        drop_waiter(core, conn);
        answer_byte(core, conn, WAIT_CANCELED);
        return 0;
    case OP_QUEUE_PUSH: {
        Item *item = malloc(sizeof(Item) + r->v1.len);
        if (item == NULL || (e = table_add(&core->table, r->key.p, r->key.len)) == NULL) {
            free(item);
            FAIL_MEMORY();
        }
        item->next = NULL;
        item->len = r->v1.len;
        memcpy(item->data, r->v1.p, r->v1.len);
        if (e->queue_tail)
            e->queue_tail->next = item;
        else
            e->queue_head = item;
        e->queue_tail = item;
        e->queue_len++;
        release_one(core, e);
        return 0;
    }
    case OP_QUEUE_POP: {
        e = table_get(&core->table, r->key.p, r->key.len);
        if (e == NULL || e->queue_len == 0)
            return answer_i64(core, conn, 0);
        Item *item = e->queue_head;
        if (answer_i64(core, conn, (int64_t)e->queue_len) < 0 ||
            answer_blob(core, conn, item->data, item->len) < 0)
            return -1;
        e->queue_head = item->next;
        if (e->queue_head == NULL)
            e->queue_tail = NULL;
        e->queue_len--;
        free(item);
        maybe_drop(core, e);
        return 0;
    }
    case OP_QUEUE_LEN:
        e = table_get(&core->table, r->key.p, r->key.len);
        return answer_i64(core, conn, e == NULL ? 0 : (int64_t)e->queue_len);
    case OP_LIST_KEYS: {
        if (answer_i64(core, conn, (int64_t)core->num_keys) < 0)
            return -1;
        for (size_t i = 0; i < core->table.cap; i++) {
            e = core->table.slots[i];
            if (e != NULL && e->value != NULL && answer_blob(core, conn, e->key, e->key_len) < 0)
                return -1;
        }
        return 0;
    }
    default:
        return protocol_error(core, "unexpected %s request", OP_NAMES[r->op]);
    }
}

/* Serve every whole request held, until the peer must read its answers first. */
static void serve_held(Core *core, Conn *conn) {
    Request r;
    while (!conn->closed && !conn->paused && conn->in_start < conn->in.len &&
           conn->in.len >= conn->in_need) {
        size_t need;
        ssize_t size = parse(core, conn->in.data + conn->in_start, conn->in.len - conn->in_start,
                             &r, &need);
        if (size == 0) {
            conn->in_need = conn->in_start + need;
            break;
        }
        if (size < 0 || serve(core, conn, &r) < 0) {
            if (!conn->closed) { /* the answers before the broken request are its own */
                complain(core, conn, "closing the connection from %s: %s", core->why);
                if (flush(core, conn) == 0)
                    conn_close(core, conn);
            }
            return;
        }
        conn->in_start += (size_t)size;
        conn->in_need = 0;
        if (conn->out.len - conn->out_sent >= OUT_HIGH) {
            if (flush(core, conn) < 0)
                return;
            if (conn->out.len - conn->out_sent >= OUT_HIGH)
                conn->paused = 1; /* read again once the peer has read */
        }
    }
    if (conn->closed)
        return;
    if (conn->in_start == conn->in.len) {
        conn->in.len = conn->in_start = 0;
        conn->in_need = 0;
        if (conn->in.cap > 4 * READ_CHUNK)
            buf_free(&conn->in);
    } else if (conn->in_start > 0 && !conn->paused) {
        memmove(conn->in.data, conn->in.data + conn->in_start, conn->in.len - conn->in_start);
        conn->in.len -= conn->in_start;
        if (conn->in_need)
            conn->in_need -= conn->in_start;
        conn->in_start = 0;
    }
    schedule(core, conn);
}

static void on_readable(Core *core, Conn *conn) {
    for (int reads = 0; reads < 4 && !conn->closed && !conn->paused; reads++) {
        size_t want = READ_CHUNK;
        if (conn->in_need > conn->in.len && conn->in_need - conn->in.len > want)
            want = conn->in_need - conn->in.len; /* the rest of a large request at once */
        if (buf_reserve(&conn->in, want) < 0) {
            complain(core, conn, "closing the connection from %s: %s", "out of memory");
            conn_close(core, conn);
            return;
        }
        ssize_t n = recv(conn->fd, conn->in.data + conn->in.len, conn->in.cap - conn->in.len, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                conn_close(core, conn);
            return;
        }
        if (n == 0) { /* the peer closed its side: answer what it sent, then close ours */
            if (flush(core, conn) == 0)
                conn_close(core, conn);
            return;
        }
        conn->in.len += (size_t)n;
        serve_held(core, conn);
        if ((size_t)n < want)
            return; /* the kernel had no more */
    }
}

static void on_writable(Core *core, Conn *conn) {
    if (flush(core, conn) < 0)
        return;
    if (conn->paused && conn->out.len - conn->out_sent < OUT_HIGH / 4) {
        conn->paused = 0;
        serve_held(core, conn);
    }
    schedule(core, conn);
}

/* Write the answers gathered while handling one event (the woken waiters' too). */
static void write_pending(Core *core) {
    while (core->pending != NULL) {
        Conn *conn = core->pending;
        core->pending = conn->next_pending;
        conn->pending = 0;
        if (conn->closed)
            continue;
        if (flush(core, conn) == 0)
            update_events(core, conn);
    }
}

static int listen_all(Core *core);
static void unlisten_all(Core *core);

/* Open descriptors of this process (less the one the count holds), or -1. */
static int64_t count_open_fds(void) {
    DIR *dir = opendir("/proc/self/fd");
    if (dir == NULL)
        return -1;
    int64_t n = 0;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL)
        if (entry->d_name[0] != '.')
            n++;
    closedir(dir);
    return n > 0 ? n - 1 : 0;
}

/* Free descriptors: counted at most every recount_ms; in between, only this server's
   own connections come and go fast enough to matter (Acceptor._free_fds). */
static int64_t free_fds(Core *core) {
    int64_t now = now_ms();
    size_t conns = core->num_connections;
    if (now - core->counted_ms >= core->recount_ms) {
        int64_t counted = count_open_fds();
        if (counted < 0 && (errno == EMFILE || errno == ENFILE))
            return 0; /* none free: the count itself needs one */
        core->counted_ms = now;
        core->counted_fds = counted < 0 ? (int64_t)conns : counted;
        core->counted_conns = conns;
    }
    return core->fd_limit - (core->counted_fds + (int64_t)conns - (int64_t)core->counted_conns);
}

/* Close the oldest connection not validated yet if it has had its time: 1 if it did. */
static int evict_oldest(Core *core) {
    Conn *oldest = core->hs_first;
    if (oldest == NULL || now_ms() - oldest->since_ms < core->evict_after_ms)
        return 0;
    core->unvalidated_closed++;
    conn_close(core, oldest);
    return 1;
}

/* Why no connection may be taken now (a kind, and `why` written), or NULL. */
static const char *full(Core *core, char *why, size_t size) {
    if (core->handshakes >= core->max_handshakes && !evict_oldest(core)) {
        snprintf(why, size, "%zu connections have not validated yet", core->handshakes);
        return "handshakes";
    }
    int64_t free = free_fds(core);
    if (free <= core->fd_reserve) {
        evict_oldest(core); /* room for the process's own work, or the next connection */
        snprintf(why, size,
                 "%lld descriptors are free (limit %lld; %lld are kept for this process's "
                 "own work)",
                 (long long)free, (long long)core->fd_limit, (long long)core->fd_reserve);
        return "descriptors";
    }
    return NULL;
}

static void stop_accepting(Core *core, const char *kind, const char *why) {
    if (core->accepting) {
        unlisten_all(core);
        char message[400];
        snprintf(message, sizeof message,
                 "the workers' store is not accepting connections for now: %s; they wait in "
                 "the listen backlog",
                 why);
        notice(core, kind, message);
    }
    if (!core->retry_ms)
        core->retry_ms = now_ms() + core->recheck_ms;
}

/* While not accepting, after room was made or at the retry time (Acceptor._on_room). */
static void look_again(Core *core) {
    char why[256];
    if (full(core, why, sizeof why) != NULL) {
        if (!core->retry_ms)
            core->retry_ms = now_ms() + core->recheck_ms;
        return;
    }
    core->retry_ms = 0;
    if (listen_all(core) < 0)
        return; /* (cannot happen with listeners that were in the set) */
    char message[256];
    snprintf(message, sizeof message,
             "the workers' store accepts connections again (%zu open; %llu closed so far "
             "that had not validated)",
             core->num_connections, (unsigned long long)core->unvalidated_closed);
    notice(core, "resume", message);
}

static void on_accept(Core *core, int listener) {
    for (int i = 0; i < ACCEPT_BATCH && core->accepting; i++) {
        char why[256];
        const char *kind = full(core, why, sizeof why);
        if (kind != NULL) {
            stop_accepting(core, kind, why);
            return;
        }
        int fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* The backlog would wake the loop at once, again and again: pause. */
                snprintf(why, sizeof why, "accept() failed: %s", strerror(errno));
                stop_accepting(core, "accept", why);
            }
            return; /* EAGAIN, or an error the next readiness will repeat */
        }
        Conn *conn = calloc(1, sizeof(Conn));
        if (conn == NULL || core->num_connections >= core->max_connections) {
            if (conn != NULL) {
                Conn probe = {.fd = fd};
                char count[64];
                snprintf(count, sizeof count, "%zu clients are connected (the limit)",
                         core->num_connections);
                complain(core, &probe, "refusing the connection from %s: %s", count);
                free(conn);
            }
            close(fd);
            continue;
        }
        conn->fd = fd;
        conn->events = EPOLLIN;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = conn};
        if (epoll_ctl(core->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
            close(fd);
            free(conn);
            continue;
        }
        conn->next = core->conns;
        if (core->conns)
            core->conns->prev = conn;
        core->conns = conn;
        conn->since_ms = now_ms();
        conn->hs_prev = core->hs_last;
        if (core->hs_last)
            core->hs_last->hs_next = conn;
        else
            core->hs_first = conn;
        core->hs_last = conn;
        core->handshakes++;
        set_count(&core->num_connections, core->num_connections + 1);
    }
}

static int listen_all(Core *core) {
    for (Py_ssize_t i = 0; i < core->nlisteners; i++) {
        struct epoll_event ev = {.events = EPOLLIN,
                                 .data.ptr = (void *)(uintptr_t)(LISTEN_TAG_BASE + i)};
        if (epoll_ctl(core->epfd, EPOLL_CTL_ADD, core->listeners[i], &ev) < 0)
            return -1;
    }
    core->accepting = 1;
    return 0;
}

static void unlisten_all(Core *core) {
    for (Py_ssize_t k = 0; k < core->nlisteners; k++)
        epoll_ctl(core->epfd, EPOLL_CTL_DEL, core->listeners[k], NULL);
    core->accepting = 0;
}

/* -- the Python type ----------------------------------------------------------------- */

static int Core_init(Core *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"listeners", "max_connections", "max_frame", "max_key", "complain",
                            "max_handshakes", "fd_limit", "fd_reserve", "evict_after_ms",
                            "recheck_ms", "recount_ms", "notice", NULL};
    PyObject *listeners, *complain_fn, *notice_fn;
    Py_ssize_t max_connections, max_frame, max_key, max_handshakes;
    long long fd_limit, fd_reserve, evict_after_ms, recheck_ms, recount_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnOnLLLLLO", names, &listeners,
                                     &max_connections, &max_frame, &max_key, &complain_fn,
                                     &max_handshakes, &fd_limit, &fd_reserve, &evict_after_ms,
                                     &recheck_ms, &recount_ms, &notice_fn))
        return -1;
    if (max_handshakes < 1) {
        PyErr_SetString(PyExc_ValueError, "max_handshakes must be at least 1");
        return -1;
    }
    if (self->ready || self->listeners != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a core is initialised once");
        return -1;
    }
    self->epfd = self->stopfd = -1;
    PyObject *fast = PySequence_Fast(listeners, "listeners must be a sequence of descriptors");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    self->listeners = PyMem_Calloc(n ? (size_t)n : 1, sizeof(int));
    if (self->listeners == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (fd == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        self->listeners[i] = (int)fd;
    }
    Py_DECREF(fast);
    self->nlisteners = n;
    self->max_connections = (size_t)max_connections;
    self->max_frame = (size_t)max_frame;
    self->max_key = (size_t)max_key;
    Py_INCREF(complain_fn);
    self->complain = complain_fn;
    Py_INCREF(notice_fn);
    self->notice = notice_fn;
    self->max_handshakes = (size_t)max_handshakes;
    self->fd_limit = fd_limit;
    self->fd_reserve = fd_reserve;
    self->evict_after_ms = evict_after_ms;
    self->recheck_ms = recheck_ms;
    self->recount_ms = recount_ms;
    self->counted_ms = INT64_MIN / 2; /* count at the first accept */
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    self->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (self->epfd < 0 || self->stopfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = STOP_TAG};
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, self->stopfd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (listen_all(self) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void close_all(Core *core) {
    while (core->conns != NULL)
        conn_close(core, core->conns);
    core->pending = NULL;
    bury(core);
}

static PyObject *Core_serve(Core *self, PyObject *unused) {
    (void)unused;
    if (!self->ready || self->served) {
        PyErr_SetString(PyExc_RuntimeError, "this core cannot serve (not initialised, or served)");
        return NULL;
    }
    self->served = 1;
    struct epoll_event events[MAX_EVENTS];
    int stop = 0, failure = 0;
    self->gil = PyEval_SaveThread();
    while (!stop) {
        int timeout = -1;
        if (!self->accepting) {
            int64_t now = now_ms();
            int due = self->retry_ms && now >= self->retry_ms;
            if (due)
                self->retry_ms = 0;
            int look = due || self->room;
            self->room = 0;
            if (look)
                look_again(self); /* closing the oldest waiting one makes room again */
            if (!self->accepting && self->room) {
                timeout = 0; /* it did: look again after this turn's events */
            } else if (!self->accepting && self->retry_ms) {
                int64_t left = self->retry_ms - now_ms();
                timeout = left > 0 ? (int)left : 0;
            }
        } else {
            self->room = 0;
        }
        int n = epoll_wait(self->epfd, events, MAX_EVENTS, timeout);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            failure = errno;
            break;
        }
        for (int i = 0; i < n && !stop; i++) {
            void *tag = events[i].data.ptr;
            uintptr_t value = (uintptr_t)tag;
            if (tag == STOP_TAG) {
                stop = 1;
            } else if (value >= LISTEN_TAG_BASE &&
                       value < (uintptr_t)(LISTEN_TAG_BASE + self->nlisteners)) {
                on_accept(self, self->listeners[value - LISTEN_TAG_BASE]);
            } else {
                Conn *conn = tag;
                if (conn->closed)
                    continue;
                uint32_t what = events[i].events;
                if (what & EPOLLOUT)
                    on_writable(self, conn);
                if (!conn->closed && (what & EPOLLIN))
                    on_readable(self, conn);
                if (!conn->closed && (what & (EPOLLHUP | EPOLLERR)))
                    conn_close(self, conn); /* reset, or gone both ways */
                write_pending(self);
            }
        }
        write_pending(self);
        bury(self);
    }
    close_all(self);
    PyEval_RestoreThread(self->gil);
    self->gil = NULL;
    if (failure) {
        errno = failure;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Core_stop(Core *self, PyObject *unused) {
    (void)unused;
    if (self->ready) {
        uint64_t one = 1;
        ssize_t written = write(self->stopfd, &one, sizeof one);
        (void)written; /* a full counter already asks the loop to stop */
    }
    Py_RETURN_NONE;
}

static PyObject *Core_num_keys(Core *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(__atomic_load_n(&self->num_keys, __ATOMIC_RELAXED));
}

static PyObject *Core_num_connections(Core *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(__atomic_load_n(&self->num_connections, __ATOMIC_RELAXED));
}

static void Core_dealloc(Core *self) {
    for (size_t i = 0; i < self->table.cap; i++) {
        Entry *e = self->table.slots[i];
        if (e != NULL) {
            for (Link *l = e->first; l != NULL; l = l->next)
                l->entry = NULL; /* waiters are freed with their connections */
            entry_free(e);
        }
    }
    free(self->table.slots);
    if (self->listeners != NULL) { /* initialised: 0 is a descriptor, -1 is none */
        if (self->epfd >= 0)
            close(self->epfd);
        if (self->stopfd >= 0)
            close(self->stopfd);
    }
    PyMem_Free(self->listeners);
    Py_XDECREF(self->complain);
    Py_XDECREF(self->notice);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Core_methods[] = {
    {"serve", (PyCFunction)Core_serve, METH_NOARGS,
     "Serve until stop() is called; every connection is closed before it returns."},
    {"stop", (PyCFunction)Core_stop, METH_NOARGS,
     "Ask serve() to return (from any thread; idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"num_keys", (getter)Core_num_keys, NULL, "Keys holding a value.", NULL},
    {"num_connections", (getter)Core_num_connections, NULL, "Clients connected now.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "elastrun.store.torchwire.wirecore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "torch's TCPStore protocol served from an epoll loop in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "wirecore",
    "The workers' store's compiled engine (see TorchWireServer).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_wirecore(void) {
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
