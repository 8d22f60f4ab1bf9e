/* Non-blocking receive of a burst of whole ZeroMQ messages in a single call, GIL kept.
 *
 * The subscriber's hot path receives three frames per batch. Through pyzmq that is six calls
 * (recv and RCVMORE per frame), each with its own option handling and GIL release: about
 * 4.7 us per message measured. Here one call receives up to a given number of messages with
 * libzmq's own zmq_msg_* functions. A live batch message (three frames, the second one an
 * 8-byte sequence) comes back as (seq, payload) without objects for the other two frames;
 * any other message as the list of its frames, for the caller to judge.
 *
 * libzmq is not linked: the functions are the ones of the libzmq pyzmq has loaded, passed in
 * by address (kvevents._zmq_direct finds it and checks its version), so the socket handles
 * pyzmq gives out (Socket.underlying) are valid here. Calls are non-blocking, so keeping the
 * GIL costs nothing; the caller uses a socket from one thread only, as ZeroMQ requires.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#define KV_DONTWAIT 1

/* zmq_msg_t: 64 opaque bytes, pointer-aligned (zmq.h). */
typedef struct {
    union {
        unsigned char bytes[64];
        void *align;
    } u;
} kv_msg_t;

typedef int (*msg_init_fn)(kv_msg_t *);
typedef int (*msg_recv_fn)(kv_msg_t *, void *, int);
typedef void *(*msg_data_fn)(kv_msg_t *);
typedef size_t (*msg_size_fn)(const kv_msg_t *);
typedef int (*msg_more_fn)(const kv_msg_t *);
typedef int (*msg_close_fn)(kv_msg_t *);
typedef int (*errno_fn)(void);

static msg_init_fn kv_msg_init;
static msg_recv_fn kv_msg_recv;
static msg_data_fn kv_msg_data;
static msg_size_fn kv_msg_size;
static msg_more_fn kv_msg_more;
static msg_close_fn kv_msg_close;
static errno_fn kv_errno;

static void *
address_of(PyObject *obj)
{
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "null function address");
    }
    return p;
}

PyDoc_STRVAR(init_doc,
"init(msg_init, msg_recv, msg_data, msg_size, msg_more, msg_close, errno)\n"
"--\n\n"
"Addresses of libzmq's zmq_msg_init, zmq_msg_recv, zmq_msg_data, zmq_msg_size,\n"
"zmq_msg_more, zmq_msg_close and zmq_errno, from the libzmq pyzmq loaded.");

static PyObject *
kv_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *fns[7];
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "init() takes 7 addresses");
        return NULL;
    }
    for (int i = 0; i < 7; i++) {
        fns[i] = address_of(args[i]);
        if (fns[i] == NULL) {
            return NULL;
        }
    }
    kv_msg_init = (msg_init_fn)fns[0];
    kv_msg_recv = (msg_recv_fn)fns[1];
    kv_msg_data = (msg_data_fn)fns[2];
    kv_msg_size = (msg_size_fn)fns[3];
    kv_msg_more = (msg_more_fn)fns[4];
    kv_msg_close = (msg_close_fn)fns[5];
    kv_errno = (errno_fn)fns[6];
    Py_RETURN_NONE;
}

/* Receive the next frame into msg (initialised here). 0 on success; -1 with *err set to the
 * errno on failure (msg is then closed). */
static int
recv_msg(void *socket, kv_msg_t *msg, int *err)
{
    kv_msg_init(msg);
    for (;;) {
        if (kv_msg_recv(msg, socket, KV_DONTWAIT) >= 0) {
            return 0;
        }
        *err = kv_errno();
        if (*err != EINTR) {
            kv_msg_close(msg);
            return -1;
        }
    }
}

static PyObject *
bytes_of(kv_msg_t *msg)
{
    return PyBytes_FromStringAndSize((const char *)kv_msg_data(msg),
                                     (Py_ssize_t)kv_msg_size(msg));
}

/* Append the frames of held[0..n) as bytes to frames; 0, or -1 with a Python error set. */
static int
append_frames(PyObject *frames, kv_msg_t *held, int n)
{
    for (int i = 0; i < n; i++) {
        PyObject *frame = bytes_of(&held[i]);
        if (frame == NULL) {
            return -1;
        }
        int failed = PyList_Append(frames, frame);
        Py_DECREF(frame);
        if (failed) {
            return -1;
        }
    }
    return 0;
}

/* The live batch message held[0..3) as (seq, payload). */
static PyObject *
batch_of(kv_msg_t *held)
{
    const unsigned char *b = (const unsigned char *)kv_msg_data(&held[1]);
    uint64_t seq = 0;
    for (int i = 0; i < 8; i++) {
        seq = (seq << 8) | b[i];
    }
    PyObject *number = PyLong_FromUnsignedLongLong(seq);
    if (number == NULL) {
        return NULL;
    }
    PyObject *payload = bytes_of(&held[2]);
    if (payload == NULL) {
        Py_DECREF(number);
        return NULL;
    }
    PyObject *pair = PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(number);
        Py_DECREF(payload);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, number);
    PyTuple_SET_ITEM(pair, 1, payload);
    return pair;
}

/* Receive the rest of a message whose first frame is in held[0]. Returns a new reference to
 * its item and adds its frames' sizes to *size, or NULL with *err set (0: a Python error is
 * set; else the errno). Every frame received is closed before returning. The first three
 * frames are held as messages, so the common shape makes one bytes object; a longer message
 * turns into a list of frames. */
static PyObject *
take_message(void *socket, kv_msg_t *held, int *err, size_t *size)
{
    PyObject *frames = NULL, *item = NULL;
    int n = 1, more = kv_msg_more(&held[0]);
    *size += kv_msg_size(&held[0]);
    *err = 0;
    while (more) {
        /* The rest of a multipart message is already here: libzmq delivers it whole. */
        kv_msg_t *slot = n < 3 ? &held[n] : &held[3];
        if (recv_msg(socket, slot, err) < 0) {
            goto done;
        }
        more = kv_msg_more(slot);
        *size += kv_msg_size(slot);
        if (n < 3) {
            n++;
            continue;
        }
        /* A fourth frame or more: the message goes back as a list of its frames. */
        if (frames == NULL) {
            frames = PyList_New(0);
            if (frames == NULL || append_frames(frames, held, 3) < 0) {
                kv_msg_close(slot);
                goto done;
            }
        }
        int failed = append_frames(frames, slot, 1);
        kv_msg_close(slot);
        if (failed) {
            goto done;
        }
    }
    if (frames != NULL) {
        item = frames;
        frames = NULL;
    } else if (n == 3 && kv_msg_size(&held[1]) == 8) {
        item = batch_of(held);
    } else {
        item = PyList_New(0);
        if (item != NULL && append_frames(item, held, n) < 0) {
            Py_CLEAR(item);
        }
    }
done:
    for (int i = 0; i < n; i++) {
        kv_msg_close(&held[i]);
    }
    Py_XDECREF(frames);
    return item;
}

PyDoc_STRVAR(recv_burst_doc,
"recv_burst(socket_handle, max_messages, max_bytes) -> list\n"
"--\n\n"
"Up to max_messages whole messages waiting on the socket (Socket.underlying), stopping once\n"
"their payloads reach max_bytes (at least one message is taken). A message of three frames\n"
"whose second is 8 bytes comes back as (seq, payload), seq read big-endian; any other as the\n"
"list of its frames. An empty list when nothing is waiting. A failure after some messages\n"
"returns those (it recurs on the next call); a failure first raises OSError with libzmq's\n"
"errno.");

static PyObject *
kv_recv_burst(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (kv_msg_recv == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvevents.subscribe._zmqrecv.init() was not called");
        return NULL;
    }
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "recv_burst() takes 3 arguments");
        return NULL;
    }
    void *socket = PyLong_AsVoidPtr(args[0]);
    if (socket == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "null socket handle");
        }
        return NULL;
    }
    Py_ssize_t max_messages = PyLong_AsSsize_t(args[1]);
    if (max_messages == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t max_bytes = PyLong_AsSsize_t(args[2]);
    if (max_bytes == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (max_messages < 1 || max_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "max_messages and max_bytes must be >= 1");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t taken = 0;
    size_t bytes = 0;
    while (taken < max_messages && bytes < (size_t)max_bytes) {
        kv_msg_t held[4];
        int err = 0;
        if (recv_msg(socket, &held[0], &err) < 0) {
            if (err == EAGAIN || taken > 0) {
                return out;  /* nothing more waiting; or report the failure next call */
            }
            Py_DECREF(out);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        PyObject *item = take_message(socket, held, &err, &bytes);
        if (item == NULL) {
            if (err == 0) {  /* a Python error (memory) */
                Py_DECREF(out);
                return NULL;
            }
            if (taken > 0) {  /* libzmq delivers messages whole: not expected, but keep these */
                return out;
            }
            Py_DECREF(out);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (PyList_Append(out, item) < 0) {
            Py_DECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
        taken++;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))kv_init, METH_FASTCALL, init_doc},
    {"recv_burst", (PyCFunction)(void (*)(void))kv_recv_burst, METH_FASTCALL, recv_burst_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    /* The libzmq functions' addresses are process-wide: one interpreter's GIL. */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvevents.subscribe._zmqrecv",
    .m_doc = "Non-blocking receive of whole messages through the libzmq pyzmq loaded.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

/* Multi-phase initialisation (PEP 489). */
PyMODINIT_FUNC
PyInit__zmqrecv(void)
{
    return PyModuleDef_Init(&module);
}
