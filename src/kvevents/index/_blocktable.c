/* The prefix index's storage primitives in C: the API and semantics of _blocktable_py.py.
 *
 * U64Map is an open-addressing table of 16-byte slots {key, value} with linear probing and
 * backward-shift deletion (no tombstones). Key 0 marks an empty slot, so the entry whose key is
 * 0 lives out of line in the map itself. No Python object is held per entry, so the map is not
 * a GC type.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define MIN_CAPACITY 8
#define MASK60 ((UINT64_C(1) << 60) - 1)
/* Hashing a long token run releases the GIL; below this many bytes the switch costs more. */
#define NOGIL_BYTES 65536

typedef uint64_t (*xxh3_seeded_fn)(const void *, size_t, uint64_t);
static xxh3_seeded_fn xxh3_seeded = NULL;

typedef struct {
    uint64_t key;
    uint64_t value;
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t mask; /* capacity - 1; capacity is a power of two */
    Py_ssize_t used; /* entries in slots (the out-of-line key 0 not counted) */
    Slot zero; /* the entry of key 0, valid when has_zero */
    char has_zero;
    char is_signed; /* a negative key was stored: keys read back signed */
    Py_ssize_t readers; /* walks reading it without the GIL (changed only under the GIL) */
} U64Map;

static PyTypeObject U64MapType;

#define U64Map_Check(o) (Py_TYPE(o) == &U64MapType)

/* The murmur3 64-bit finalizer: engine hashes may be small sequential ints. */
static inline uint64_t
mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= UINT64_C(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x *= UINT64_C(0xc4ceb9fe1a85ec53);
    x ^= x >> 33;
    return x;
}

/* ---------------------------------------------------------------- conversions */

/* An int in -2**63 .. 2**64-1 as its 64-bit pattern; *neg tells whether it was negative. */
static int
key_from(PyObject *o, uint64_t *out, int *neg)
{
    int overflow;
    long long v;
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "key must be an int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred())
            return -1;
        *out = (uint64_t)v;
        *neg = v < 0;
        return 0;
    }
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (!(u == (unsigned long long)-1 && PyErr_Occurred())) {
            *out = (uint64_t)u;
            *neg = 0;
            return 0;
        }
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
    }
    PyErr_Format(PyExc_OverflowError, "key %R is outside -2**63 .. 2**64-1", o);
    return -1;
}

/* An int in 0 .. 2**64-1. */
static int
u64_from(PyObject *o, uint64_t *out, const char *what)
{
    unsigned long long u;
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    u = PyLong_AsUnsignedLongLong(o);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "%s %R is outside 0 .. 2**64-1", what, o);
        return -1;
    }
    *out = (uint64_t)u;
    return 0;
}

static PyObject *
key_to(const U64Map *m, uint64_t k)
{
    if (m->is_signed && k >= (UINT64_C(1) << 63))
        return PyLong_FromLongLong((long long)(int64_t)k);
    return PyLong_FromUnsignedLongLong(k);
}

/* ---------------------------------------------------------------- table core */

/* Slot arrays of 2 MiB and more are mapped on their own and asked to use huge pages: every
 * lookup in a large table touches a random page, and with 4 KiB pages the TLB misses cost
 * as much as the cache misses (store_chain of 16 blocks into 1.28M: 3.0 -> 2.6 us measured).
 * tracemalloc is told about these mappings, so memory measurements still see them. */
#define HUGE_BYTES ((size_t)2 << 20)
#define TRACE_DOMAIN 0x6b76 /* "kv" */

static Slot *
slots_alloc(size_t capacity)
{
    size_t bytes = capacity * sizeof(Slot);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_BYTES) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
        (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice: refused where THP is off */
        (void)PyTraceMalloc_Track(TRACE_DOMAIN, (uintptr_t)p, bytes);
        return (Slot *)p;
    }
#endif
    return PyMem_Calloc(capacity, sizeof(Slot));
}

static void
slots_free(Slot *slots, size_t capacity)
{
    size_t bytes = capacity * sizeof(Slot);
    if (slots == NULL)
        return;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_BYTES) {
        (void)PyTraceMalloc_Untrack(TRACE_DOMAIN, (uintptr_t)slots);
        munmap(slots, bytes);
        return;
    }
#endif
    PyMem_Free(slots);
}

static Slot *
map_find(U64Map *m, uint64_t k)
{
    size_t i;
    if (k == 0)
        return m->has_zero ? &m->zero : NULL;
    i = (size_t)mix64(k) & m->mask;
    for (;;) {
        Slot *s = &m->slots[i];
        if (s->key == k)
            return s;
        if (s->key == 0)
            return NULL;
        i = (i + 1) & m->mask;
    }
}

/* Loops over many keys touch one random slot each: asking for slots a few keys ahead lets
 * those cache misses overlap instead of queueing. */
#define PREFETCH_AHEAD 8

static inline void
map_prefetch(const U64Map *m, uint64_t k)
{
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&m->slots[(size_t)mix64(k) & m->mask]);
#else
    (void)m;
    (void)k;
#endif
}

static int
map_resize(U64Map *m, size_t capacity)
{
    Slot *fresh = slots_alloc(capacity);
    size_t mask = capacity - 1, i;
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i <= m->mask; i++) {
        uint64_t k = m->slots[i].key;
        size_t j;
        if (k == 0)
            continue;
        j = (size_t)mix64(k) & mask;
        while (fresh[j].key != 0)
            j = (j + 1) & mask;
        fresh[j] = m->slots[i];
    }
    slots_free(m->slots, m->mask + 1);
    m->slots = fresh;
    m->mask = mask;
    return 0;
}

/* Make room for `extra` more entries without growing again (load stays <= 0.8). */
static int
map_reserve(U64Map *m, Py_ssize_t extra)
{
    size_t capacity = m->mask + 1;
    size_t want = (size_t)m->used + (size_t)extra;
    while (want * 5 > capacity * 4)
        capacity *= 2;
    return capacity == m->mask + 1 ? 0 : map_resize(m, capacity);
}

/* The slot of key k, inserted with value 0 if absent (*created tells); NULL on MemoryError. */
static Slot *
map_upsert(U64Map *m, uint64_t k, int *created)
{
    size_t i;
    *created = 0;
    if (k == 0) {
        if (!m->has_zero) {
            m->has_zero = 1;
            m->zero.key = 0;
            m->zero.value = 0;
            *created = 1;
        }
        return &m->zero;
    }
    for (;;) {
        i = (size_t)mix64(k) & m->mask;
        for (;;) {
            Slot *s = &m->slots[i];
            if (s->key == k)
                return s;
            if (s->key == 0)
                break;
            i = (i + 1) & m->mask;
        }
        if (((size_t)m->used + 1) * 5 <= (m->mask + 1) * 4)
            break;
        if (map_resize(m, (m->mask + 1) * 2) < 0)
            return NULL;
    }
    m->slots[i].key = k;
    m->slots[i].value = 0;
    m->used++;
    *created = 1;
    return &m->slots[i];
}

static int
map_set(U64Map *m, uint64_t k, uint64_t v)
{
    int created;
    Slot *s = map_upsert(m, k, &created);
    if (s == NULL)
        return -1;
    s->value = v;
    return 0;
}

/* Remove the entry in slot s (from map_find). May shrink the table. */
static void
map_remove(U64Map *m, Slot *s)
{
    size_t mask = m->mask, i, j;
    Slot *slots = m->slots;
    if (s == &m->zero) {
        m->has_zero = 0;
        m->zero.value = 0;
        return;
    }
    i = j = (size_t)(s - slots);
    for (;;) {
        size_t home;
        uint64_t k;
        j = (j + 1) & mask;
        k = slots[j].key;
        if (k == 0)
            break;
        home = (size_t)mix64(k) & mask;
        /* The entry at j may fill the hole at i when i lies on its probe path home..j. */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            slots[i] = slots[j];
            i = j;
        }
    }
    slots[i].key = 0;
    slots[i].value = 0;
    m->used--;
    if (mask + 1 > MIN_CAPACITY && (size_t)m->used * 8 < mask + 1) {
        /* A failed shrink only keeps the larger table. */
        if (map_resize(m, (mask + 1) / 2) < 0)
            PyErr_Clear();
    }
}

static int
map_clear(U64Map *m)
{
    Slot *fresh = slots_alloc(MIN_CAPACITY);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    slots_free(m->slots, m->mask + 1);
    m->slots = fresh;
    m->mask = MIN_CAPACITY - 1;
    m->used = 0;
    m->has_zero = 0;
    m->zero.value = 0;
    return 0;
}

/* ---------------------------------------------------------------- argument parsing */

/* Positional or keyword arguments by name into out[0..nmax); a vectorcall parser. */
static int
parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
           const char *const *names, Py_ssize_t nmin, Py_ssize_t nmax, PyObject **out)
{
    Py_ssize_t i, k, nkw;
    if (kwnames == NULL && nargs >= nmin && nargs <= nmax) {
        for (i = 0; i < nargs; i++)
            out[i] = args[i];
        for (; i < nmax; i++)
            out[i] = NULL;
        return 0;
    }
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd arguments (%zd given)", fname,
                     nmax, nargs);
        return -1;
    }
    for (i = 0; i < nmax; i++)
        out[i] = i < nargs ? args[i] : NULL;
    nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        for (i = 0; i < nmax; i++) {
            if (PyUnicode_CompareWithASCIIString(name, names[i]) == 0)
                break;
        }
        if (i == nmax) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname,
                         name);
            return -1;
        }
        if (out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         names[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (i = 0; i < nmin; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname,
                         names[i]);
            return -1;
        }
    }
    return 0;
}

static int
check_map(PyObject *o, const char *what)
{
    if (U64Map_Check(o))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a U64Map, not %.100s", what, Py_TYPE(o)->tp_name);
    return -1;
}

/* A map being read without the GIL (walk with nogil) must not change: its slots could move
 * or be freed under the reader. The caller's lock should keep writers out; this refuses a
 * write that got through rather than corrupt memory. Readers and writers both hold the GIL
 * when they touch the count. */
static int
map_writable(const U64Map *m)
{
    if (m->readers == 0)
        return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "U64Map is being read without the GIL: writers must wait for readers");
    return -1;
}

/* ---------------------------------------------------------------- U64Map type */

static PyObject *
U64Map_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    U64Map *m;
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "U64Map() takes no arguments");
        return NULL;
    }
    m = (U64Map *)type->tp_alloc(type, 0);
    if (m == NULL)
        return NULL;
    m->slots = slots_alloc(MIN_CAPACITY);
    if (m->slots == NULL) {
        Py_DECREF(m);
        return PyErr_NoMemory();
    }
    m->mask = MIN_CAPACITY - 1;
    return (PyObject *)m;
}

static void
U64Map_dealloc(U64Map *m)
{
    slots_free(m->slots, m->mask + 1);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
U64Map_len(U64Map *m)
{
    return m->used + m->has_zero;
}

static int
U64Map_contains(U64Map *m, PyObject *key)
{
    uint64_t k;
    int neg;
    if (key_from(key, &k, &neg) < 0)
        return -1;
    return map_find(m, k) != NULL;
}

static PyObject *
U64Map_subscript(U64Map *m, PyObject *key)
{
    uint64_t k;
    int neg;
    Slot *s;
    if (key_from(key, &k, &neg) < 0)
        return NULL;
    s = map_find(m, k);
    if (s == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(s->value);
}

static int
U64Map_ass_subscript(U64Map *m, PyObject *key, PyObject *value)
{
    uint64_t k, v;
    int neg;
    Slot *s;
    if (map_writable(m) < 0)
        return -1;
    if (value == NULL) {
        if (key_from(key, &k, &neg) < 0)
            return -1;
        s = map_find(m, k);
        if (s == NULL) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        map_remove(m, s);
        return 0;
    }
    /* The value is checked first, as `d[k] = v` evaluates v first in the reference. */
    if (u64_from(value, &v, "value") < 0 || key_from(key, &k, &neg) < 0)
        return -1;
    if (map_set(m, k, v) < 0)
        return -1;
    if (neg)
        m->is_signed = 1;
    return 0;
}

static PyObject *
value_obj(const U64Map *m, const Slot *s)
{
    (void)m;
    return PyLong_FromUnsignedLongLong(s->value);
}

static PyObject *
key_obj(const U64Map *m, const Slot *s)
{
    return key_to(m, s->key);
}

/* A 2-tuple stealing both references (released on failure). */
static PyObject *
pair(PyObject *a, PyObject *b)
{
    PyObject *t = PyTuple_New(2);
    if (t == NULL) {
        Py_DECREF(a);
        Py_DECREF(b);
        return NULL;
    }
    PyTuple_SET_ITEM(t, 0, a);
    PyTuple_SET_ITEM(t, 1, b);
    return t;
}

static PyObject *
item_tuple(const U64Map *m, const Slot *s)
{
    PyObject *k = key_to(m, s->key), *v;
    if (k == NULL)
        return NULL;
    v = PyLong_FromUnsignedLongLong(s->value);
    if (v == NULL) {
        Py_DECREF(k);
        return NULL;
    }
    return pair(k, v);
}

typedef PyObject *(*slot_reader)(const U64Map *, const Slot *);

/* One object per entry, in table order (the out-of-line zero key first): keys(), values()
 * and items() list their entries in the same order. */
static PyObject *
collect(U64Map *m, slot_reader read)
{
    PyObject *out = PyList_New(U64Map_len(m));
    Py_ssize_t n = 0;
    size_t i;
    if (out == NULL)
        return NULL;
    for (i = 0; i <= m->mask + 1; i++) {
        const Slot *s;
        PyObject *o;
        if (i == 0) {
            if (!m->has_zero)
                continue;
            s = &m->zero;
        }
        else {
            s = &m->slots[i - 1];
            if (s->key == 0)
                continue;
        }
        o = read(m, s);
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, n++, o);
    }
    return out;
}

static PyObject *
U64Map_keys(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    return collect(m, key_obj);
}

static PyObject *
U64Map_values(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    return collect(m, value_obj);
}

static PyObject *
U64Map_items(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    return collect(m, item_tuple);
}

static PyObject *
U64Map_iter(U64Map *m)
{
    PyObject *keys = U64Map_keys(m, NULL), *it;
    if (keys == NULL)
        return NULL;
    it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static const char *const get_names[] = {"k", "default"};

static PyObject *
U64Map_get(U64Map *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[2];
    uint64_t k;
    int neg;
    Slot *s;
    if (parse_args("get", args, nargs, kwnames, get_names, 1, 2, a) < 0)
        return NULL;
    if (key_from(a[0], &k, &neg) < 0)
        return NULL;
    s = map_find(m, k);
    if (s != NULL)
        return PyLong_FromUnsignedLongLong(s->value);
    if (a[1] == NULL)
        Py_RETURN_NONE;
    Py_INCREF(a[1]);
    return a[1];
}

static PyObject *
U64Map_pop(U64Map *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[2];
    uint64_t k;
    int neg;
    Slot *s;
    PyObject *v;
    if (parse_args("pop", args, nargs, kwnames, get_names, 1, 2, a) < 0)
        return NULL;
    if (key_from(a[0], &k, &neg) < 0)
        return NULL;
    s = map_find(m, k);
    if (s == NULL) {
        if (a[1] == NULL) {
            PyErr_SetObject(PyExc_KeyError, a[0]);
            return NULL;
        }
        Py_INCREF(a[1]);
        return a[1];
    }
    if (map_writable(m) < 0)
        return NULL;
    v = PyLong_FromUnsignedLongLong(s->value);
    if (v != NULL)
        map_remove(m, s);
    return v;
}

static PyObject *
U64Map_clear_method(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    if (map_writable(m) < 0 || map_clear(m) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
U64Map_nbytes(U64Map *m, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t((m->mask + 1) * sizeof(Slot) + Py_TYPE(m)->tp_basicsize);
}

static PyMethodDef U64Map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))U64Map_get, METH_FASTCALL | METH_KEYWORDS,
     "get(k, default=None): the value of key k, or default."},
    {"pop", (PyCFunction)(void (*)(void))U64Map_pop, METH_FASTCALL | METH_KEYWORDS,
     "pop(k[, default]): remove key k and return its value; KeyError without a default."},
    {"keys", (PyCFunction)U64Map_keys, METH_NOARGS, "The keys, as a list."},
    {"values", (PyCFunction)U64Map_values, METH_NOARGS, "The values, as a list."},
    {"items", (PyCFunction)U64Map_items, METH_NOARGS, "The (key, value) pairs, as a list."},
    {"clear", (PyCFunction)U64Map_clear_method, METH_NOARGS,
     "Remove every entry and free the table back to its smallest size."},
    {NULL, NULL, 0, NULL},
};

static PyObject *
U64Map_readers(U64Map *m, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(m->readers);
}

static PyGetSetDef U64Map_getset[] = {
    {"nbytes", (getter)U64Map_nbytes, NULL, "Bytes allocated for the table (slots and struct).",
     NULL},
    {"readers", (getter)U64Map_readers, NULL, "Walks reading the table without the GIL now.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods U64Map_as_sequence = {
    .sq_contains = (objobjproc)U64Map_contains,
};

static PyMappingMethods U64Map_as_mapping = {
    .mp_length = (lenfunc)U64Map_len,
    .mp_subscript = (binaryfunc)U64Map_subscript,
    .mp_ass_subscript = (objobjargproc)U64Map_ass_subscript,
};

static PyTypeObject U64MapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvevents.index._blocktable.U64Map",
    .tp_doc = "A map of 64-bit keys to 64-bit unsigned values in a flat open-addressing table.",
    .tp_basicsize = sizeof(U64Map),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = U64Map_new,
    .tp_dealloc = (destructor)U64Map_dealloc,
    .tp_as_sequence = &U64Map_as_sequence,
    .tp_as_mapping = &U64Map_as_mapping,
    .tp_iter = (getiterfunc)U64Map_iter,
    .tp_methods = U64Map_methods,
    .tp_getset = U64Map_getset,
};

/* ---------------------------------------------------------------- helpers for functions */

/* The value of key `o` in m, or 0; -1 on a bad key. */
static int
lookup_or_zero(U64Map *m, PyObject *o, uint64_t *out)
{
    uint64_t k;
    int neg;
    Slot *s;
    if (key_from(o, &k, &neg) < 0)
        return -1;
    s = map_find(m, k);
    *out = s == NULL ? 0 : s->value;
    return 0;
}

/* Clear `bit` in blocks[oh], deleting the entry when no bit is left. */
static void
clear_bit(U64Map *blocks, uint64_t oh, uint64_t bit)
{
    Slot *s = map_find(blocks, oh);
    if (s == NULL || !(s->value & bit))
        return;
    s->value ^= bit;
    if (s->value == 0)
        map_remove(blocks, s);
}

/* 1 when a key repeats in keys[0..n), 0 when not, -1 on MemoryError. */
static int
has_repeat(const uint64_t *keys, Py_ssize_t n)
{
    size_t capacity = 16, mask, i;
    uint64_t *seen;
    int zero = 0, found = 0;
    Py_ssize_t a, b;
    if (n <= 16) {
        for (a = 1; a < n; a++)
            for (b = 0; b < a; b++)
                if (keys[a] == keys[b])
                    return 1;
        return 0;
    }
    while (capacity < (size_t)n * 2)
        capacity *= 2;
    mask = capacity - 1;
    seen = PyMem_Calloc(capacity, sizeof(uint64_t));
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (a = 0; a < n && !found; a++) {
        uint64_t k = keys[a];
        if (k == 0) {
            found = zero;
            zero = 1;
            continue;
        }
        for (i = (size_t)mix64(k) & mask; seen[i] != 0; i = (i + 1) & mask) {
            if (seen[i] == k) {
                found = 1;
                break;
            }
        }
        seen[i] = k;
    }
    PyMem_Free(seen);
    return found;
}

static int
append_steal(PyObject *list, PyObject *item)
{
    int rc;
    if (item == NULL)
        return -1;
    rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* A positive block size in tokens from an int; -1 with ValueError/TypeError set otherwise. */
static long long
block_size_from(PyObject *o)
{
    int overflow;
    long long size;
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "block_size must be an int, not %.100s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    size = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (size == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0)
        return LLONG_MAX;
    if (size <= 0 || overflow < 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %R", o);
        return -1;
    }
    return size;
}

/* ---------------------------------------------------------------- chain_hashes */

static PyObject *
init_xxh3(PyObject *Py_UNUSED(module), PyObject *address)
{
    void *fn = PyLong_AsVoidPtr(address);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "init_xxh3: the address must not be 0");
        return NULL;
    }
    xxh3_seeded = (xxh3_seeded_fn)fn;
    Py_RETURN_NONE;
}

static void
hash_blocks(const unsigned char *p, size_t step, Py_ssize_t count, uint64_t h, uint64_t *out)
{
    Py_ssize_t i;
    for (i = 0; i < count; i++) {
        h = xxh3_seeded(p + (size_t)i * step, step, h) & MASK60;
        out[i] = h;
    }
}

static const char *const chain_names[] = {"packed", "block_size", "seed"};

static PyObject *
chain_hashes(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
             PyObject *kwnames)
{
    PyObject *a[3], *out = NULL;
    Py_buffer view;
    long long block_size;
    int neg;
    uint64_t seed, *hashes, local[64];
    Py_ssize_t count = 0, i;
    if (parse_args("chain_hashes", args, nargs, kwnames, chain_names, 3, 3, a) < 0)
        return NULL;
    if (xxh3_seeded == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "chain_hashes: xxh3 is not initialised (init_xxh3)");
        return NULL;
    }
    if ((block_size = block_size_from(a[1])) < 0)
        return NULL;
    if (key_from(a[2], &seed, &neg) < 0)
        return NULL;
    if (PyObject_GetBuffer(a[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if ((unsigned long long)block_size <= (unsigned long long)(view.len / 4))
        count = view.len / (Py_ssize_t)(block_size * 4);
    hashes = count <= 64 ? local : PyMem_Malloc((size_t)count * sizeof(uint64_t));
    if (hashes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* The buffer stays exported (so it cannot be resized) while the GIL is released. */
    if (view.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        hash_blocks(view.buf, (size_t)block_size * 4, count, seed, hashes);
        Py_END_ALLOW_THREADS
    }
    else
        hash_blocks(view.buf, (size_t)block_size * 4, count, seed, hashes);
    out = PyList_New(count);
    for (i = 0; out != NULL && i < count; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(hashes[i]);
        if (o == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, o);
    }
    if (hashes != local)
        PyMem_Free(hashes);
done:
    PyBuffer_Release(&view);
    return out;
}

/* ---------------------------------------------------------------- token packing */

static inline void
put_u32le(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* The payload size and signedness of a msgpack int format byte beyond the fixints (uint8 ..
 * uint64, int8 .. int64); 0 for any other format. */
static inline int
int_format(unsigned char b, int *size, int *is_signed)
{
    if (b < 0xcc || b > 0xd3)
        return 0;
    *is_signed = b >= 0xd0;
    *size = 1 << (b - (*is_signed ? 0xd0 : 0xcc)); /* 1, 2, 4, 8 */
    return 1;
}

static inline uint64_t
get_be(const unsigned char *p, int nbytes)
{
    uint64_t v = 0;
    int i;
    for (i = 0; i < nbytes; i++)
        v = (v << 8) | p[i];
    return v;
}

/* One msgpack int in 0 .. 2**32-1 at *pp; 0 for anything else. */
static int
msgpack_token(const unsigned char **pp, const unsigned char *end, uint32_t *out)
{
    const unsigned char *p = *pp;
    int size, is_signed = 0;
    uint64_t v;
    unsigned char b;
    if (p >= end)
        return 0;
    b = *p++;
    if (b <= 0x7f) {
        *out = b;
        *pp = p;
        return 1;
    }
    /* Token ids of real vocabularies are uint16 or uint32: decode those without a loop. */
    if (b == 0xcd && end - p >= 2) {
        *out = ((uint32_t)p[0] << 8) | p[1];
        *pp = p + 2;
        return 1;
    }
    if (b == 0xce && end - p >= 4) {
        *out = ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
        *pp = p + 4;
        return 1;
    }
    if (!int_format(b, &size, &is_signed))
        return 0;
    if (end - p < size || (is_signed && (p[0] & 0x80)))
        return 0;
    v = get_be(p, size);
    if (v > UINT32_MAX)
        return 0;
    *out = (uint32_t)v;
    *pp = p + size;
    return 1;
}

/* The packed tokens of a msgpack array that is the whole of [p, end); NULL if it is not one. */
static PyObject *
msgpack_pack(const unsigned char *p, const unsigned char *end)
{
    Py_ssize_t count, i;
    PyObject *out;
    unsigned char *dst;
    if (p >= end)
        return NULL;
    if ((*p & 0xf0) == 0x90) {
        count = *p & 0x0f;
        p += 1;
    }
    else if (*p == 0xdc && end - p >= 3) {
        count = (Py_ssize_t)get_be(p + 1, 2);
        p += 3;
    }
    else if (*p == 0xdd && end - p >= 5) {
        count = (Py_ssize_t)get_be(p + 1, 4);
        p += 5;
    }
    else
        return NULL;
    if (count > end - p) /* every element takes at least one byte */
        return NULL;
    out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL)
        return NULL;
    dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (i = 0; i < count; i++) {
        uint32_t v;
        if (!msgpack_token(&p, end, &v)) {
            Py_DECREF(out);
            return NULL;
        }
        put_u32le(dst + 4 * i, v);
    }
    if (p != end) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static const char *const raw_names[] = {"raw"};

typedef PyObject *(*packer)(const unsigned char *, const unsigned char *);

static PyObject *
pack_tokens(const char *fname, packer pack, PyObject *const *args, Py_ssize_t nargs,
            PyObject *kwnames)
{
    PyObject *raw, *out;
    Py_buffer view;
    if (parse_args(fname, args, nargs, kwnames, raw_names, 1, 1, &raw) < 0)
        return NULL;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    out = pack(view.buf, (const unsigned char *)view.buf + view.len);
    PyBuffer_Release(&view);
    if (out == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    return out;
}

static PyObject *
pack_msgpack_tokens(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                    PyObject *kwnames)
{
    return pack_tokens("pack_msgpack_tokens", msgpack_pack, args, nargs, kwnames);
}

/* ---------------------------------------------------------------- storing a chain */

/* The engine hashes of a chain as 64-bit keys into keys[0..n); *any_neg: one was negative. */
static int
engine_keys(PyObject *ehs, Py_ssize_t n, uint64_t *keys, int *any_neg)
{
    PyObject **items = PySequence_Fast_ITEMS(ehs);
    Py_ssize_t i;
    int neg;
    *any_neg = 0;
    for (i = 0; i < n; i++) {
        if (key_from(items[i], &keys[i], &neg) < 0)
            return -1;
        *any_neg |= neg;
    }
    return 0;
}

/* 1 when no key of keys[0..n) repeats and none is in engine yet, 0 when not, -1 on error. */
static int
all_fresh(U64Map *engine, const uint64_t *keys, Py_ssize_t n)
{
    Py_ssize_t i;
    int repeat = has_repeat(keys, n);
    if (repeat != 0)
        return repeat < 0 ? -1 : 0;
    for (i = 0; i < n && i < PREFETCH_AHEAD; i++)
        map_prefetch(engine, keys[i]);
    for (i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            map_prefetch(engine, keys[i + PREFETCH_AHEAD]);
        if (map_find(engine, keys[i]) != NULL)
            return 0;
    }
    return 1;
}

/* engine[keys[i]] = ours[i] and `bit` ORed into blocks[ours[i]] for each i; the ours whose bit
 * was already set go to `shared` (a list). Room is reserved first, so only the list can fail. */
static int
store_keys(U64Map *blocks, U64Map *engine, uint64_t bit, const uint64_t *keys,
           const uint64_t *ours, Py_ssize_t n, PyObject *shared)
{
    Py_ssize_t i;
    if (map_reserve(engine, n) < 0 || map_reserve(blocks, n) < 0)
        return -1;
    for (i = 0; i < n && i < PREFETCH_AHEAD; i++) {
        map_prefetch(engine, keys[i]);
        map_prefetch(blocks, ours[i]);
    }
    for (i = 0; i < n; i++) {
        int created;
        Slot *s;
        if (i + PREFETCH_AHEAD < n) {
            map_prefetch(engine, keys[i + PREFETCH_AHEAD]);
            map_prefetch(blocks, ours[i + PREFETCH_AHEAD]);
        }
        if (map_set(engine, keys[i], ours[i]) < 0)
            return -1;
        s = map_upsert(blocks, ours[i], &created);
        if (s == NULL)
            return -1;
        if (created)
            s->value = bit;
        else if (!(s->value & bit))
            s->value |= bit;
        else if (append_steal(shared, PyLong_FromUnsignedLongLong(ours[i])) < 0)
            return -1;
    }
    return 0;
}

/* The shared list of a fresh chain stored, or None (nothing changed) when it is not fresh. */
static PyObject *
store_fresh(U64Map *blocks, U64Map *engine, uint64_t bit, uint64_t *keys, Py_ssize_t n,
            int any_neg, int fresh)
{
    PyObject *shared;
    if (fresh < 0)
        return NULL;
    if (!fresh)
        Py_RETURN_NONE;
    shared = PyList_New(0);
    if (shared == NULL)
        return NULL;
    if (store_keys(blocks, engine, bit, keys, keys + n, n, shared) < 0) {
        Py_DECREF(shared);
        return NULL;
    }
    if (any_neg)
        engine->is_signed = 1;
    return shared;
}

/* Scratch for 2n keys: on the stack for a typical event, else on the heap. */
#define LOCAL_KEYS 64

static uint64_t *
keys_alloc(Py_ssize_t n, uint64_t *local)
{
    uint64_t *keys;
    if (2 * n <= LOCAL_KEYS)
        return local;
    keys = PyMem_Malloc((size_t)n * 2 * sizeof(uint64_t));
    if (keys == NULL)
        PyErr_NoMemory();
    return keys;
}

static const char *const store_names[] = {"blocks", "engine", "bit", "engine_hashes", "ours"};

static PyObject *
store_chain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
            PyObject *kwnames)
{
    PyObject *a[5], *ehs = NULL, *ours = NULL, *out = NULL;
    uint64_t bit, local[LOCAL_KEYS], *keys = NULL;
    Py_ssize_t n = 0, i;
    int any_neg, fresh;
    if (parse_args("store_chain", args, nargs, kwnames, store_names, 5, 5, a) < 0)
        return NULL;
    if (check_map(a[0], "blocks") < 0 || check_map(a[1], "engine") < 0 ||
        map_writable((U64Map *)a[0]) < 0 || map_writable((U64Map *)a[1]) < 0)
        return NULL;
    ehs = PySequence_Fast(a[3], "engine_hashes must be a sequence");
    if (ehs == NULL)
        return NULL;
    ours = PySequence_Fast(a[4], "ours must be a sequence");
    if (ours == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(ehs);
    if (n != PySequence_Fast_GET_SIZE(ours)) {
        PyErr_SetString(PyExc_ValueError, "engine_hashes and ours differ in length");
        goto done;
    }
    keys = keys_alloc(n, local);
    if (keys == NULL || engine_keys(ehs, n, keys, &any_neg) < 0)
        goto done;
    fresh = all_fresh((U64Map *)a[1], keys, n);
    for (i = 0; fresh > 0 && i < n; i++)
        if (u64_from(PySequence_Fast_GET_ITEM(ours, i), &keys[n + i], "value") < 0)
            goto done;
    if (fresh > 0 && u64_from(a[2], &bit, "bit") < 0)
        goto done;
    out = store_fresh((U64Map *)a[0], (U64Map *)a[1], bit, keys, n, any_neg, fresh);
done:
    if (keys != local)
        PyMem_Free(keys);
    Py_XDECREF(ehs);
    Py_XDECREF(ours);
    return out;
}

static const char *const run_names[] = {"blocks",  "engine",     "bit", "engine_hashes",
                                        "packed", "block_size", "seed"};

/* store_run: chain_hashes(packed, block_size, seed) then store_chain with those hashes, in one
 * call and without an int object per block. packed must hold exactly one block per engine
 * hash (ValueError otherwise: the caller checks token counts, this only guards memory). */
static PyObject *
store_run(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
          PyObject *kwnames)
{
    PyObject *a[7], *ehs, *out = NULL;
    Py_buffer view;
    uint64_t bit, seed, local[LOCAL_KEYS], *keys = NULL;
    long long size;
    Py_ssize_t n;
    int any_neg, neg, fresh;
    if (parse_args("store_run", args, nargs, kwnames, run_names, 7, 7, a) < 0)
        return NULL;
    if (xxh3_seeded == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "store_run: xxh3 is not initialised (init_xxh3)");
        return NULL;
    }
    if (check_map(a[0], "blocks") < 0 || check_map(a[1], "engine") < 0 ||
        map_writable((U64Map *)a[0]) < 0 || map_writable((U64Map *)a[1]) < 0 ||
        u64_from(a[2], &bit, "bit") < 0 || (size = block_size_from(a[5])) < 0 ||
        key_from(a[6], &seed, &neg) < 0)
        return NULL;
    ehs = PySequence_Fast(a[3], "engine_hashes must be a sequence");
    if (ehs == NULL)
        return NULL;
    if (PyObject_GetBuffer(a[4], &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(ehs);
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(ehs);
    /* Divisions, not a product: size and n come from the caller and may be anything. */
    if (n == 0 ? view.len != 0
               : size > view.len / 4 || view.len % ((Py_ssize_t)size * 4) != 0 ||
                     view.len / ((Py_ssize_t)size * 4) != n) {
        PyErr_Format(PyExc_ValueError,
                     "packed holds %zd bytes, not %zd blocks of block_size %lld tokens",
                     view.len, n, size);
        goto done;
    }
    keys = keys_alloc(n, local);
    if (keys == NULL || engine_keys(ehs, n, keys, &any_neg) < 0)
        goto done;
    fresh = all_fresh((U64Map *)a[1], keys, n);
    if (fresh > 0)
        hash_blocks(view.buf, (size_t)size * 4, n, seed, keys + n);
    out = store_fresh((U64Map *)a[0], (U64Map *)a[1], bit, keys, n, any_neg, fresh);
done:
    if (keys != NULL && keys != local)
        PyMem_Free(keys);
    PyBuffer_Release(&view);
    Py_DECREF(ehs);
    return out;
}

/* ---------------------------------------------------------------- removal */

static const char *const remove_names[] = {"blocks", "engine", "tombs", "bit", "engine_hashes"};

static PyObject *
remove_blocks(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
              PyObject *kwnames)
{
    PyObject *a[5], *ehs, *unknown;
    U64Map *blocks, *engine, *tombs;
    uint64_t bit;
    Py_ssize_t n, i;
    if (parse_args("remove_blocks", args, nargs, kwnames, remove_names, 5, 5, a) < 0)
        return NULL;
    if (check_map(a[0], "blocks") < 0 || check_map(a[1], "engine") < 0 ||
        check_map(a[2], "tombs") < 0 || u64_from(a[3], &bit, "bit") < 0)
        return NULL;
    if (map_writable((U64Map *)a[0]) < 0 || map_writable((U64Map *)a[1]) < 0 ||
        map_writable((U64Map *)a[2]) < 0)
        return NULL;
    blocks = (U64Map *)a[0];
    engine = (U64Map *)a[1];
    tombs = (U64Map *)a[2];
    ehs = PySequence_Fast(a[4], "engine_hashes must be a sequence");
    if (ehs == NULL)
        return NULL;
    unknown = PyList_New(0);
    n = PySequence_Fast_GET_SIZE(ehs);
    for (i = 0; unknown != NULL && i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(ehs, i);
        uint64_t eh, oh;
        int neg;
        Slot *s;
        if (key_from(item, &eh, &neg) < 0)
            goto fail;
        s = map_find(engine, eh);
        if (s == NULL) {
            if (PyList_Append(unknown, item) < 0)
                goto fail;
            continue;
        }
        oh = s->value;
        map_remove(engine, s);
        if (map_set(tombs, eh, oh) < 0)
            goto fail;
        if (neg)
            tombs->is_signed = 1;
        clear_bit(blocks, oh, bit);
    }
    Py_DECREF(ehs);
    return unknown;
fail:
    Py_DECREF(ehs);
    Py_DECREF(unknown);
    return NULL;
}

static const char *const drop_names[] = {"blocks", "engine", "bit"};

static PyObject *
drop_holder(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
            PyObject *kwnames)
{
    PyObject *a[3];
    U64Map *blocks, *engine;
    uint64_t bit;
    size_t i;
    if (parse_args("drop_holder", args, nargs, kwnames, drop_names, 3, 3, a) < 0)
        return NULL;
    if (check_map(a[0], "blocks") < 0 || check_map(a[1], "engine") < 0 ||
        u64_from(a[2], &bit, "bit") < 0)
        return NULL;
    blocks = (U64Map *)a[0];
    engine = (U64Map *)a[1];
    if (map_writable(blocks) < 0 || map_writable(engine) < 0)
        return NULL;
    /* The same map as both ends up empty anyway; iterating it while removing would not be safe. */
    if (blocks != engine) {
        if (engine->has_zero)
            clear_bit(blocks, engine->zero.value, bit);
        for (i = 0; i <= engine->mask; i++)
            if (engine->slots[i].key != 0)
                clear_bit(blocks, engine->slots[i].value, bit);
    }
    if (map_clear(engine) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- walks */

static const char *const walk_names[] = {"blocks", "hashes", "allowed", "nogil"};

static int
walk_emit(PyObject *out, uint64_t bits, Py_ssize_t depth)
{
    PyObject *b = PyLong_FromUnsignedLongLong(bits), *d;
    if (b == NULL)
        return -1;
    d = PyLong_FromSsize_t(depth);
    if (d == NULL) {
        Py_DECREF(b);
        return -1;
    }
    return append_steal(out, pair(b, d));
}

/* The walk over keys already converted, touching no Python object: it may run without the
 * GIL. A group leaves at each depth where some alive bit is missing; at most 64 groups leave
 * (each takes a bit) and the last may stay to the end: 65 at most. */
#define WALK_GROUPS 65

static int
walk_keys(const U64Map *m, const uint64_t *keys, Py_ssize_t count, uint64_t allowed,
          uint64_t *bits, Py_ssize_t *depths)
{
    const Slot *s;
    uint64_t alive, mask;
    Py_ssize_t depth = 1;
    int groups = 0;
    if (count == 0)
        return 0;
    s = map_find((U64Map *)m, keys[0]);
    alive = (s == NULL ? 0 : s->value) & allowed;
    while (alive && depth < count) {
        s = map_find((U64Map *)m, keys[depth]);
        mask = (s == NULL ? 0 : s->value) & alive;
        if (mask != alive) {
            bits[groups] = alive ^ mask;
            depths[groups++] = depth;
            alive = mask;
        }
        depth++;
    }
    if (alive) {
        bits[groups] = alive;
        depths[groups++] = depth;
    }
    return groups;
}

/* walk(..., nogil=True): convert every key first, then walk without the GIL. The map is
 * marked read for the while, so a writer that gets in raises instead of moving its slots. */
static PyObject *
walk_nogil(U64Map *blocks, PyObject **items, Py_ssize_t count, uint64_t allowed)
{
    uint64_t *keys, bits[WALK_GROUPS];
    Py_ssize_t i, depths[WALK_GROUPS];
    PyObject *out;
    int neg, groups;
    keys = PyMem_Malloc((size_t)(count > 0 ? count : 1) * sizeof(uint64_t));
    if (keys == NULL)
        return PyErr_NoMemory();
    for (i = 0; i < count; i++) {
        if (key_from(items[i], &keys[i], &neg) < 0) {
            PyMem_Free(keys);
            return NULL;
        }
    }
    blocks->readers++;
    Py_BEGIN_ALLOW_THREADS
    groups = walk_keys(blocks, keys, count, allowed, bits, depths);
    Py_END_ALLOW_THREADS
    blocks->readers--;
    PyMem_Free(keys);
    out = PyList_New(0);
    for (i = 0; out != NULL && i < groups; i++)
        if (walk_emit(out, bits[i], depths[i]) < 0)
            Py_CLEAR(out);
    return out;
}

static PyObject *
walk(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[4], *seq, *out;
    PyObject **items;
    U64Map *blocks;
    uint64_t alive = 0, allowed, mask;
    Py_ssize_t count, depth = 1;
    int nogil = 0;
    if (parse_args("walk", args, nargs, kwnames, walk_names, 3, 4, a) < 0)
        return NULL;
    if (check_map(a[0], "blocks") < 0 || u64_from(a[2], &allowed, "allowed") < 0)
        return NULL;
    if (a[3] != NULL && (nogil = PyObject_IsTrue(a[3])) < 0)
        return NULL;
    blocks = (U64Map *)a[0];
    seq = PySequence_Fast(a[1], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    items = PySequence_Fast_ITEMS(seq);
    count = PySequence_Fast_GET_SIZE(seq);
    if (nogil) {
        out = walk_nogil(blocks, items, count, allowed);
        Py_DECREF(seq);
        return out;
    }
    out = PyList_New(0);
    if (out == NULL)
        goto done;
    if (count > 0) {
        if (lookup_or_zero(blocks, items[0], &alive) < 0)
            goto fail;
        alive &= allowed;
    }
    while (alive && depth < count) {
        if (lookup_or_zero(blocks, items[depth], &mask) < 0)
            goto fail;
        mask &= alive;
        if (mask != alive) {
            if (walk_emit(out, alive ^ mask, depth) < 0)
                goto fail;
            alive = mask;
        }
        depth++;
    }
    if (alive && walk_emit(out, alive, depth) < 0)
        goto fail;
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_DECREF(seq);
    return out;
}

/* The walk of walk_keys over the chained hashes of a token run, each hashed a few blocks
 * before the walk gets to it (a request that matches a few blocks is not hashed to its end).
 * No Python object is touched: it may run without the GIL. */
static int
walk_chain(const U64Map *m, const unsigned char *p, size_t step, Py_ssize_t count, uint64_t h,
           uint64_t allowed, uint64_t *bits, Py_ssize_t *depths)
{
    /* Block i's key is hashed PREFETCH_AHEAD blocks before the walk reaches it and its slot
     * asked for then: the chain's hashing does not wait on the table, so the slots' cache
     * misses overlap instead of queueing one per block (the walk over a large table is
     * mostly those misses). Hashing a few blocks past where a walk stops costs little. */
    uint64_t ahead[PREFETCH_AHEAD];
    const Slot *s;
    uint64_t alive, mask;
    Py_ssize_t depth = 1, hashed;
    int groups = 0;
    if (count == 0)
        return 0;
    for (hashed = 0; hashed < count && hashed < PREFETCH_AHEAD; hashed++) {
        h = xxh3_seeded(p + (size_t)hashed * step, step, h) & MASK60;
        ahead[hashed] = h;
        map_prefetch(m, h);
    }
    s = map_find((U64Map *)m, ahead[0]);
    alive = (s == NULL ? 0 : s->value) & allowed;
    while (alive && depth < count) {
        uint64_t key = ahead[depth % PREFETCH_AHEAD];
        if (hashed < count) {
            /* the slot just read (depth - 1) takes block `hashed`, PREFETCH_AHEAD on */
            h = xxh3_seeded(p + (size_t)hashed * step, step, h) & MASK60;
            ahead[hashed % PREFETCH_AHEAD] = h;
            map_prefetch(m, h);
            hashed++;
        }
        s = map_find((U64Map *)m, key);
        mask = (s == NULL ? 0 : s->value) & alive;
        if (mask != alive) {
            bits[groups] = alive ^ mask;
            depths[groups++] = depth;
            alive = mask;
        }
        depth++;
    }
    if (alive) {
        bits[groups] = alive;
        depths[groups++] = depth;
    }
    return groups;
}

static const char *const chain_walk_names[] = {"blocks", "packed",  "block_size",
                                               "seed",   "allowed", "nogil"};

/* chain_walk: walk(blocks, chain_hashes(packed, block_size, seed), allowed) without an int
 * object per block; with nogil, the hashing and the walk run without the GIL (the table
 * refuses writes meanwhile, as for walk). */
static PyObject *
chain_walk(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
           PyObject *kwnames)
{
    PyObject *a[6], *out;
    Py_buffer view;
    U64Map *blocks;
    uint64_t seed, allowed, bits[WALK_GROUPS];
    Py_ssize_t count = 0, i, depths[WALK_GROUPS];
    long long size;
    int neg, nogil = 0, groups;
    if (parse_args("chain_walk", args, nargs, kwnames, chain_walk_names, 5, 6, a) < 0)
        return NULL;
    if (xxh3_seeded == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "chain_walk: xxh3 is not initialised (init_xxh3)");
        return NULL;
    }
    if (check_map(a[0], "blocks") < 0 || (size = block_size_from(a[2])) < 0 ||
        key_from(a[3], &seed, &neg) < 0 || u64_from(a[4], &allowed, "allowed") < 0)
        return NULL;
    if (a[5] != NULL && (nogil = PyObject_IsTrue(a[5])) < 0)
        return NULL;
    if (PyObject_GetBuffer(a[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    blocks = (U64Map *)a[0];
    if (size <= view.len / 4)
        count = view.len / ((Py_ssize_t)size * 4);
    if (nogil) {
        blocks->readers++;
        Py_BEGIN_ALLOW_THREADS
        groups = walk_chain(blocks, view.buf, (size_t)size * 4, count, seed, allowed, bits,
                            depths);
        Py_END_ALLOW_THREADS
        blocks->readers--;
    }
    else
        groups = walk_chain(blocks, view.buf, (size_t)size * 4, count, seed, allowed, bits,
                            depths);
    PyBuffer_Release(&view);
    out = PyList_New(0);
    for (i = 0; out != NULL && i < groups; i++)
        if (walk_emit(out, bits[i], depths[i]) < 0)
            Py_CLEAR(out);
    return out;
}

static const char *const extend_names[] = {"blocks", "hashes", "depth", "mask"};

static PyObject *
extend(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[4], *seq, *out = NULL;
    PyObject **items;
    U64Map *blocks;
    uint64_t mask, v;
    Py_ssize_t count, depth;
    int overflow;
    if (parse_args("extend", args, nargs, kwnames, extend_names, 4, 4, a) < 0)
        return NULL;
    if (check_map(a[0], "blocks") < 0 || u64_from(a[3], &mask, "mask") < 0)
        return NULL;
    if (!PyLong_Check(a[2])) {
        PyErr_Format(PyExc_TypeError, "depth must be an int, not %.100s",
                     Py_TYPE(a[2])->tp_name);
        return NULL;
    }
    blocks = (U64Map *)a[0];
    seq = PySequence_Fast(a[1], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    items = PySequence_Fast_ITEMS(seq);
    count = PySequence_Fast_GET_SIZE(seq);
    depth = (Py_ssize_t)PyLong_AsLongLongAndOverflow(a[2], &overflow);
    if (overflow > 0) { /* past the end already */
        Py_INCREF(a[2]);
        out = a[2];
        goto done;
    }
    if (overflow < 0)
        depth = -count - 1;
    else if (depth == -1 && PyErr_Occurred())
        goto done;
    /* A negative depth indexes from the end, as in the reference. */
    while (depth < count) {
        Py_ssize_t at = depth < 0 ? depth + count : depth;
        if (at < 0) {
            PyErr_SetString(PyExc_IndexError, "hashes index out of range");
            goto done;
        }
        if (lookup_or_zero(blocks, items[at], &v) < 0)
            goto done;
        if (!(v & mask))
            break;
        depth++;
    }
    out = PyLong_FromSsize_t(depth);
done:
    Py_DECREF(seq);
    return out;
}

/* ---------------------------------------------------------------- module */

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL | METH_KEYWORDS

static PyMethodDef module_methods[] = {
    {"init_xxh3", init_xxh3, METH_O,
     "init_xxh3(address): the address of XXH3_64bits_withSeed, for chain_hashes."},
    {"chain_hashes", FASTCALL(chain_hashes),
     "chain_hashes(packed, block_size, seed): chained xxh3 of full blocks, 60 bits each."},
    {"pack_msgpack_tokens", FASTCALL(pack_msgpack_tokens),
     "pack_msgpack_tokens(raw): a msgpack array of uint32 ints as packed uint32 LE, or None."},
    {"store_chain", FASTCALL(store_chain),
     "store_chain(blocks, engine, bit, engine_hashes, ours): store fresh blocks of a holder."},
    {"store_run", FASTCALL(store_run),
     "store_run(blocks, engine, bit, engine_hashes, packed, block_size, seed): chain_hashes "
     "then store_chain, in one call."},
    {"remove_blocks", FASTCALL(remove_blocks),
     "remove_blocks(blocks, engine, tombs, bit, engine_hashes): the unknown engine hashes."},
    {"drop_holder", FASTCALL(drop_holder),
     "drop_holder(blocks, engine, bit): clear a holder's bit everywhere, empty its map."},
    {"walk", FASTCALL(walk),
     "walk(blocks, hashes, allowed, nogil=False): (bits, depth) per match group; nogil: "
     "convert the keys, then walk without the GIL (writers to blocks raise meanwhile)."},
    {"chain_walk", FASTCALL(chain_walk),
     "chain_walk(blocks, packed, block_size, seed, allowed, nogil=False): walk over the "
     "chained hashes of a token run, hashing as it goes; nogil: without the GIL."},
    {"extend", FASTCALL(extend),
     "extend(blocks, hashes, depth, mask): the first depth no holder of mask has."},
    {NULL, NULL, 0, NULL},
};

static int
module_exec(PyObject *m)
{
    /* Readying a static type twice is a no-op, so a second import in another interpreter or
     * after a reload shares the one type. */
    if (PyType_Ready(&U64MapType) < 0)
        return -1;
    Py_INCREF(&U64MapType);
    if (PyModule_AddObject(m, "U64Map", (PyObject *)&U64MapType) < 0) {
        Py_DECREF(&U64MapType);
        return -1;
    }
    return PyModule_AddStringConstant(m, "IMPLEMENTATION", "c");
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* U64Map is a static type and xxh3's address is process-wide: one interpreter's GIL. */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvevents.index._blocktable",
    .m_doc = "The prefix index's table primitives in C (see _table_py for the spec).",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

/* Multi-phase initialisation (PEP 489). */
PyMODINIT_FUNC
PyInit__blocktable(void)
{
    return PyModuleDef_Init(&module_def);
}
