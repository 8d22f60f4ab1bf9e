/* The JSON scanners of HTTP request bodies in C: the API and semantics of _scan_py.py.
 *
 * pack_json_tokens reads a JSON array of token ids (ints in 0 .. 2**32-1) into packed uint32
 * little-endian bytes in one pass, without a Python int per token; pack_json_member finds a
 * top-level member of a JSON object and packs it, with the byte span of its value, so that the
 * rest of the body can be decoded apart. Neither validates more than it reads: a body it does
 * not take is None, and the caller decodes it whole (which names what is wrong with it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline void
put_u32le(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* ---------------------------------------------------------------- an array of tokens */

static inline const unsigned char *
json_ws(const unsigned char *p, const unsigned char *end)
{
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    return p;
}

/* One JSON integer in 0 .. 2**32-1 at *pp ("-0" reads as 0, like the reference's decoder). */
static int
json_token(const unsigned char **pp, const unsigned char *end, uint32_t *out)
{
    const unsigned char *p = *pp;
    int minus = 0;
    uint64_t v = 0;
    if (p < end && *p == '-') {
        minus = 1;
        p++;
    }
    if (p >= end || *p < '0' || *p > '9')
        return 0;
    if (*p == '0') {
        p++;
    }
    else {
        while (p < end && *p >= '0' && *p <= '9') {
            v = v * 10 + (uint64_t)(*p - '0');
            if (v > UINT32_MAX)
                return 0;
            p++;
        }
    }
    if (p < end && ((*p >= '0' && *p <= '9') || *p == '.' || *p == 'e' || *p == 'E'))
        return 0; /* a leading zero, or a float */
    if (minus && v != 0)
        return 0;
    *out = (uint32_t)v;
    *pp = p;
    return 1;
}

/* The usual token: 1 to 8 digits without a leading zero (so it cannot overflow) followed by a
 * separator, with more than 10 bytes left to look ahead; 0 when it does not apply. */
static inline int
json_short_token(const unsigned char **pp, const unsigned char *end, uint32_t *out)
{
    const unsigned char *p = *pp, *q;
    unsigned d;
    uint32_t v;
    if (end - p <= 10 || (d = (unsigned)(p[0] - '1')) >= 9)
        return 0;
    v = d + 1;
    for (q = p + 1; (d = (unsigned)(*q - '0')) < 10 && q - p < 8; q++)
        v = v * 10 + d;
    if (*q != ',' && *q != ']' && *q != ' ')
        return 0;
    *out = v;
    *pp = q;
    return 1;
}

/* The tokens of a non-empty array, from its first token on, into dst (count in *count): the
 * end of the array (just past its ']'), or NULL if it is not an array of such ints. */
static const unsigned char *
json_array_tokens(const unsigned char *p, const unsigned char *end, unsigned char *dst,
                  Py_ssize_t *count)
{
    for (;;) {
        uint32_t v;
        if (json_short_token(&p, end, &v)) {
            put_u32le(dst + 4 * (*count)++, v);
            /* ", " then the next number, the usual layout: room to look was checked above */
            if (p[0] == ',' && p[1] == ' ' && (unsigned)(p[2] - '0') < 10) {
                p += 2;
                continue;
            }
        }
        else if (json_token(&p, end, &v))
            put_u32le(dst + 4 * (*count)++, v);
        else
            return NULL;
        p = json_ws(p, end);
        if (p < end && *p == ',') {
            p = json_ws(p + 1, end);
            continue;
        }
        return p < end && *p == ']' ? p + 1 : NULL;
    }
}

/* The packed tokens of a JSON array of ints spanning [p, end); NULL if it is not one. */
static PyObject *
json_pack(const unsigned char *p, const unsigned char *end)
{
    Py_ssize_t count = 0;
    PyObject *out;
    unsigned char *dst;
    p = json_ws(p, end);
    if (p >= end || *p != '[')
        return NULL;
    p = json_ws(p + 1, end);
    /* n tokens take at least 2n + 1 bytes: "[" digit ("," digit)* "]" */
    out = PyBytes_FromStringAndSize(NULL, ((end - p) / 2 + 1) * 4);
    if (out == NULL)
        return NULL;
    dst = (unsigned char *)PyBytes_AS_STRING(out);
    if (p < end && *p == ']')
        p++;
    else
        p = json_array_tokens(p, end, dst, &count);
    if (p == NULL || json_ws(p, end) != end) {
        Py_DECREF(out);
        return NULL;
    }
    if (_PyBytes_Resize(&out, count * 4) < 0)
        return NULL;
    return out;
}

/* pack_json_tokens(raw): the packed tokens of a JSON array of uint32 ints (bytes, a buffer or
 * str); None if raw is not exactly such an array (surrounding whitespace aside). */
static PyObject *
pack_json_tokens(PyObject *Py_UNUSED(module), PyObject *raw)
{
    PyObject *out;
    Py_buffer view;
    if (PyUnicode_Check(raw)) {
        Py_ssize_t size;
        const char *text = PyUnicode_AsUTF8AndSize(raw, &size);
        if (text == NULL)
            return NULL;
        out = json_pack((const unsigned char *)text, (const unsigned char *)text + size);
    }
    else {
        if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0)
            return NULL;
        out = json_pack(view.buf, (const unsigned char *)view.buf + view.len);
        PyBuffer_Release(&view);
    }
    if (out == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    return out;
}

/* ---------------------------------------------------------------- a member of an object */

/* The end of the JSON string starting at p (a '"'), just past its closing quote; NULL if it
 * does not end within [p, end). */
static const unsigned char *
json_skip_string(const unsigned char *p, const unsigned char *end)
{
    for (p++; p < end; p++) {
        if (*p == '\\')
            p++;
        else if (*p == '"')
            return p + 1;
    }
    return NULL;
}

/* The end of the JSON value starting at p, scanned structurally (strings, nesting); the value
 * itself is not validated. NULL if it does not end within [p, end). */
static const unsigned char *
json_skip_value(const unsigned char *p, const unsigned char *end)
{
    Py_ssize_t depth = 0;
    if (p >= end)
        return NULL;
    if (*p != '{' && *p != '[' && *p != '"') {
        while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\n' &&
               *p != '\r' && *p != '\t')
            p++;
        return p;
    }
    while (p < end) {
        unsigned char c = *p;
        if (c == '"') {
            p = json_skip_string(p, end);
            if (p == NULL)
                return NULL;
            if (depth == 0)
                return p;
            continue;
        }
        if (c == '{' || c == '[')
            depth++;
        else if (c == '}' || c == ']') {
            if (--depth == 0)
                return p + 1;
        }
        p++;
    }
    return NULL;
}

/* The value of the first top-level member `key` of the JSON object in [p, end), scanned
 * structurally; NULL when the body is not an object this scan reads or the key is absent. */
static const unsigned char *
json_member(const unsigned char *p, const unsigned char *end, const Py_buffer *key)
{
    p = json_ws(p, end);
    if (p >= end || *p != '{')
        return NULL;
    p = json_ws(p + 1, end);
    while (p < end && *p == '"') {
        const unsigned char *name = p + 1, *name_end = json_skip_string(p, end), *value;
        if (name_end == NULL)
            return NULL;
        p = json_ws(name_end, end);
        if (p >= end || *p != ':')
            return NULL;
        value = json_ws(p + 1, end);
        if (name_end - 1 - name == key->len && memcmp(name, key->buf, (size_t)key->len) == 0)
            return value;
        p = json_skip_value(value, end);
        if (p == NULL)
            return NULL;
        p = json_ws(p, end);
        if (p >= end || *p != ',')
            return NULL;
        p = json_ws(p + 1, end);
    }
    return NULL;
}

/* (packed, start, end) of the flat int array at `value` (offsets from `start`), None when
 * there is none; NULL on error. */
static PyObject *
member_tokens(const unsigned char *start, const unsigned char *value, const unsigned char *end)
{
    const unsigned char *close;
    PyObject *packed;
    if (value == NULL || value >= end || *value != '[')
        Py_RETURN_NONE;
    /* A flat array of ints holds no ']' but its last: find it fast, then let the packer
     * check that the span is such an array. */
    close = memchr(value, ']', (size_t)(end - value));
    if (close == NULL)
        Py_RETURN_NONE;
    packed = json_pack(value, close + 1);
    if (packed == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Nnn)", packed, (Py_ssize_t)(value - start),
                         (Py_ssize_t)(close + 1 - start));
}

/* pack_json_member(body, key): the packed tokens of the top-level member `key` of a JSON
 * object, with the byte span of its value: (packed, start, end). None when the body is not an
 * object this scan can read, the key does not appear unescaped, or its value is not a flat
 * array of ints in 0 .. 2**32-1. Only the first such member is read; the caller decodes the
 * rest of the body itself (and so sees a repeated key). */
static PyObject *
pack_json_member(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result;
    Py_buffer body, key;
    const unsigned char *start, *end;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "pack_json_member() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &body, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &key, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&body);
        return NULL;
    }
    start = body.buf;
    end = start + body.len;
    result = member_tokens(start, json_member(start, end, &key), end);
    PyBuffer_Release(&key);
    PyBuffer_Release(&body);
    return result;
}


/* ---------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"pack_json_tokens", pack_json_tokens, METH_O,
     "pack_json_tokens(raw, /): a JSON array of uint32 ints as packed uint32 LE, or None."},
    {"pack_json_member", (PyCFunction)(void (*)(void))pack_json_member, METH_FASTCALL,
     "pack_json_member(body, key, /): (packed tokens, start, end) of a top-level int array "
     "member of a JSON object, or None."},
    {NULL, NULL, 0, NULL},
};

static int
module_exec(PyObject *m)
{
    return PyModule_AddStringConstant(m, "IMPLEMENTATION", "c");
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* No state at all: any interpreter may load it, each with its own GIL. */
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvevents.http._jsonscan",
    .m_doc = "The JSON scanners of HTTP request bodies in C (see _scan_py for the spec).",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

/* Multi-phase initialisation (PEP 489). */
PyMODINIT_FUNC
PyInit__jsonscan(void)
{
    return PyModuleDef_Init(&module_def);
}
