/* Non-blocking receive of one whole ZeroMQ message in a single call, GIL kept.
 *
 * The subscriber's hot path receives three frames per batch. Through pyzmq that is six calls
 * (recv and RCVMORE per frame), each with its own option handling and GIL release: about
 * 4.7 us per message measured. Here one call receives every frame with libzmq's own
 * zmq_msg_* functions and returns them as bytes.
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

/* Receive one frame into a new bytes object; *more tells whether another frame follows.
 * Returns NULL with *err set to the errno on failure (no Python error set). */
static PyObject *
recv_frame(void *socket, int *more, int *err)
{
    kv_msg_t msg;
    kv_msg_init(&msg);
    for (;;) {
        if (kv_msg_recv(&msg, socket, KV_DONTWAIT) >= 0) {
            break;
        }
        *err = kv_errno();
        if (*err != EINTR) {
            kv_msg_close(&msg);
            return NULL;
        }
    }
    size_t size = kv_msg_size(&msg);
    PyObject *frame = PyBytes_FromStringAndSize((const char *)kv_msg_data(&msg),
                                                (Py_ssize_t)size);
    *more = kv_msg_more(&msg);
    kv_msg_close(&msg);
    if (frame == NULL) {
        *err = 0;  /* a Python error (memory) is set */
    }
    return frame;
}

PyDoc_STRVAR(recv_doc,
"recv(socket_handle) -> list[bytes] | None\n"
"--\n\n"
"Every frame of the next message on the socket (Socket.underlying), or None when none is\n"
"waiting. Raises OSError with libzmq's errno on another failure.");

static PyObject *
kv_recv(PyObject *self, PyObject *handle)
{
    if (kv_msg_recv == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvevents.subscribe._zmqrecv.init() was not called");
        return NULL;
    }
    void *socket = PyLong_AsVoidPtr(handle);
    if (socket == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "null socket handle");
        }
        return NULL;
    }
    int more = 0, err = 0;
    PyObject *frame = recv_frame(socket, &more, &err);
    if (frame == NULL) {
        if (err == EAGAIN) {
            Py_RETURN_NONE;
        }
        if (err != 0) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return NULL;
    }
    PyObject *frames = PyList_New(1);
    if (frames == NULL) {
        Py_DECREF(frame);
        return NULL;
    }
    PyList_SET_ITEM(frames, 0, frame);
    while (more) {
        /* The rest of a multipart message is already here: libzmq delivers it whole. */
        frame = recv_frame(socket, &more, &err);
        if (frame == NULL) {
            if (err != 0) {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
            }
            Py_DECREF(frames);
            return NULL;
        }
        if (PyList_Append(frames, frame) < 0) {
            Py_DECREF(frame);
            Py_DECREF(frames);
            return NULL;
        }
        Py_DECREF(frame);
    }
    return frames;
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))kv_init, METH_FASTCALL, init_doc},
    {"recv", kv_recv, METH_O, recv_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "kvevents.subscribe._zmqrecv",
    "Whole-message non-blocking receive through the libzmq pyzmq loaded.",
    -1,
    methods,
};

PyMODINIT_FUNC
PyInit__zmqrecv(void)
{
    return PyModule_Create(&module);
}
