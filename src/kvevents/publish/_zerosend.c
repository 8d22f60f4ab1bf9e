/* Send a batch's three frames in one call, the payload without a copy, GIL kept.
 *
 * Copying a large payload into a new libzmq message costs the engine's thread a malloc and,
 * in a busy process, fresh pages: an 8,192-token prefill (29 KB) took 5 to 7 minor page
 * faults per send, a third of publish()'s time. Here libzmq gets a message that points into
 * the payload's bytes object (kept alive by a reference), so the engine's thread copies
 * nothing.
 *
 * libzmq frees a message from whichever of its threads drops the last copy, where the GIL
 * may not be taken (taking it there would make those threads wait for the engine). So the
 * free callback only moves the reference onto a list under a plain lock, and the next send
 * (or release()) drops the listed references on the caller's thread, which holds the GIL.
 *
 * libzmq is not linked: the functions are the ones of the libzmq pyzmq has loaded, passed in
 * by address (as in kvevents.subscribe._zmqrecv).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

#define KV_DONTWAIT 1
#define KV_SNDMORE 2

typedef struct {
    union {
        unsigned char bytes[64];
        void *align;
    } u;
} kv_msg_t;

typedef void (*free_fn)(void *, void *);
typedef int (*msg_init_data_fn)(kv_msg_t *, void *, size_t, free_fn, void *);
typedef int (*msg_send_fn)(kv_msg_t *, void *, int);
typedef int (*msg_close_fn)(kv_msg_t *);
typedef int (*send_fn)(void *, const void *, size_t, int);
typedef int (*errno_fn)(void);

static msg_init_data_fn kv_msg_init_data;
static msg_send_fn kv_msg_send;
static msg_close_fn kv_msg_close;
static send_fn kv_send;
static errno_fn kv_errno;

/* A payload libzmq holds; on the released list once libzmq has let go of it. */
typedef struct held {
    PyObject *payload;
    struct held *next;
} held_t;

static PyThread_type_lock released_lock;
static held_t *released;
static Py_ssize_t outstanding; /* payloads given to libzmq and not yet released (GIL) */

/* libzmq's free callback: any thread, no GIL. */
static void
on_free(void *data, void *hint)
{
    held_t *held = (held_t *)hint;
    (void)data;
    PyThread_acquire_lock(released_lock, WAIT_LOCK);
    held->next = released;
    released = held;
    PyThread_release_lock(released_lock);
}

/* Drop the references libzmq has given back; GIL held. */
static Py_ssize_t
release_all(void)
{
    PyThread_acquire_lock(released_lock, WAIT_LOCK);
    held_t *held = released;
    released = NULL;
    PyThread_release_lock(released_lock);
    Py_ssize_t count = 0;
    while (held != NULL) {
        held_t *next = held->next;
        Py_DECREF(held->payload);
        free(held);
        held = next;
        count++;
    }
    outstanding -= count;
    return count;
}

static void *
address_of(PyObject *obj)
{
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "null address");
    }
    return p;
}

PyDoc_STRVAR(init_doc,
"init(msg_init_data, msg_send, msg_close, send, errno)\n"
"--\n\n"
"Addresses of libzmq's zmq_msg_init_data, zmq_msg_send, zmq_msg_close, zmq_send and\n"
"zmq_errno, from the libzmq pyzmq loaded.");

static PyObject *
kv_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *fns[5];
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "init() takes 5 addresses");
        return NULL;
    }
    for (int i = 0; i < 5; i++) {
        fns[i] = address_of(args[i]);
        if (fns[i] == NULL) {
            return NULL;
        }
    }
    if (released_lock == NULL) {
        released_lock = PyThread_allocate_lock();
        if (released_lock == NULL) {
            return PyErr_NoMemory();
        }
    }
    kv_msg_init_data = (msg_init_data_fn)fns[0];
    kv_msg_send = (msg_send_fn)fns[1];
    kv_msg_close = (msg_close_fn)fns[2];
    kv_send = (send_fn)fns[3];
    kv_errno = (errno_fn)fns[4];
    Py_RETURN_NONE;
}

/* A message lending the payload's memory to libzmq (a reference is held until on_free).
 * Returns 0, libzmq's errno, or -1 with a Python error set. */
static int
lend(kv_msg_t *msg, PyObject *payload)
{
    held_t *held = (held_t *)malloc(sizeof(held_t));
    if (held == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (kv_msg_init_data(msg, PyBytes_AS_STRING(payload), (size_t)PyBytes_GET_SIZE(payload),
                         on_free, held) < 0) {
        free(held);
        return kv_errno();
    }
    Py_INCREF(payload);
    held->payload = payload;
    held->next = NULL;
    outstanding++;
    return 0;
}

static int
send_bytes(void *socket, PyObject *frame, int flags)
{
    return kv_send(socket, PyBytes_AS_STRING(frame), (size_t)PyBytes_GET_SIZE(frame),
                   flags) < 0 ? kv_errno() : 0;
}

/* Every libzmq call before the last frame that could fail is made before the first frame
 * is sent, so a failure never leaves a message half sent. libzmq takes a multipart message
 * whole or not at all: only the first frame can block. */
static int
send_frames(void *socket, PyObject *const *frames, Py_ssize_t min_borrow)
{
    PyObject *payload = frames[2];
    int borrow = PyBytes_GET_SIZE(payload) >= min_borrow;
    kv_msg_t msg;
    int err = borrow ? lend(&msg, payload) : 0;
    if (err != 0) {
        return err;
    }
    err = send_bytes(socket, frames[0], KV_DONTWAIT | KV_SNDMORE);
    if (err == 0) {
        err = send_bytes(socket, frames[1], KV_DONTWAIT | KV_SNDMORE);
    }
    if (err == 0 && !borrow) {
        return send_bytes(socket, payload, KV_DONTWAIT);
    }
    if (err == 0 && kv_msg_send(&msg, socket, KV_DONTWAIT) < 0) {
        err = kv_errno();
    }
    if (err != 0 && borrow) {
        kv_msg_close(&msg); /* calls on_free: released by the next call */
    }
    return err;
}

PyDoc_STRVAR(send3_doc,
"send3(socket_handle, topic, seq, payload, min_borrow) -> int\n"
"--\n\n"
"Send three frames without blocking; 0, or libzmq's errno (EAGAIN: nothing was sent).\n"
"A payload of at least min_borrow bytes is lent to libzmq instead of copied.");

static PyObject *
kv_send3(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (kv_send == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvevents.publish._zerosend.init() was not called");
        return NULL;
    }
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "send3() takes 5 arguments");
        return NULL;
    }
    void *socket = address_of(args[0]);
    if (socket == NULL) {
        return NULL;
    }
    for (int i = 1; i < 4; i++) {
        if (!PyBytes_CheckExact(args[i])) {
            PyErr_SetString(PyExc_TypeError, "send3() frames must be bytes");
            return NULL;
        }
    }
    Py_ssize_t min_borrow = PyLong_AsSsize_t(args[4]);
    if (min_borrow < 0 && PyErr_Occurred()) {
        return NULL;
    }
    release_all();
    int err = send_frames(socket, args + 1, min_borrow);
    if (err < 0) {
        return NULL;
    }
    return PyLong_FromLong(err);
}

PyDoc_STRVAR(release_doc,
"release() -> int\n"
"--\n\n"
"Drop the payloads libzmq has let go of since the last call; how many.");

static PyObject *
kv_release(PyObject *self, PyObject *unused)
{
    return PyLong_FromSsize_t(release_all());
}

PyDoc_STRVAR(outstanding_doc,
"outstanding() -> int\n"
"--\n\n"
"Payloads lent to libzmq and not yet released.");

static PyObject *
kv_outstanding(PyObject *self, PyObject *unused)
{
    return PyLong_FromSsize_t(outstanding);
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))kv_init, METH_FASTCALL, init_doc},
    {"send3", (PyCFunction)(void (*)(void))kv_send3, METH_FASTCALL, send3_doc},
    {"release", kv_release, METH_NOARGS, release_doc},
    {"outstanding", kv_outstanding, METH_NOARGS, outstanding_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "kvevents.publish._zerosend",
    "Three-frame non-blocking send, the payload lent to libzmq instead of copied.",
    -1,
    methods,
};

PyMODINIT_FUNC
PyInit__zerosend(void)
{
    return PyModule_Create(&module);
}
