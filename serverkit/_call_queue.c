/* serverkit._call_queue: the C twin of serverkit.io_thread.CallQueuePython (optional).
 *
 * new_call_queue() -> a queue of an IoThread's calls: put(item) (any thread, the event loop's),
 * take(wake_fd) (the I/O thread only) -> the oldest item, waiting for one while there is none.
 *
 * take(wake_fd) first adds 1 to the eventfd ``wake_fd`` (-1: none), the wake-up of the event
 * loop for the call the thread just finished, and then, when nothing is queued, waits for a put,
 * in ONE release of the GIL: the Python twin (os.eventfd_write, then SimpleQueue.get) takes the
 * GIL back between the two, and on a server with one message a cycle the loop, just woken by
 * that write, often holds it by then, so the thread went to sleep once more to get it for a few
 * bytecodes (docs/BENCHMARKS.md, session 23, store23). A failed write raises OSError (the errno
 * of write(2)) and takes nothing: the item stays queued, as in the twin.
 *
 * The items are a list, touched only with the GIL held; ``waiting`` (the taker sleeps, or is
 * about to, on ``sem``) is set by take and cleared by the put that posts ``sem``, both under the
 * GIL, so a put never posts twice for one wait and none is lost.
 * tests/unit/test_call_queue.py holds the two to the same answers.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <semaphore.h>
#include <stdint.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    PyObject *items;  /* list: put and not yet taken, oldest first */
    int waiting;      /* the taker waits on sem for the next put */
    sem_t sem;
} CallQueue;

static PyTypeObject CallQueueType;

static PyObject *CallQueue_put(CallQueue *self, PyObject *item)
{
    if (PyList_Append(self->items, item) != 0) {
        return NULL;
    }
    if (self->waiting) {
        self->waiting = 0;
        sem_post(&self->sem);
    }
    Py_RETURN_NONE;
}

/* The oldest item, taken out (the list is not empty). */
static PyObject *take_first(CallQueue *self)
{
    PyObject *item = PyList_GET_ITEM(self->items, 0);
    Py_INCREF(item);
    if (PySequence_DelItem(self->items, 0) != 0) {
        Py_DECREF(item);
        return NULL;
    }
    return item;
}

/* sem_wait until posted (a signal's EINTR waits again). */
static void wait_posted(CallQueue *self)
{
    while (sem_wait(&self->sem) != 0 && errno == EINTR) {
    }
}

static PyObject *CallQueue_take(CallQueue *self, PyObject *arg)
{
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < -1 || fd > INT_MAX) {
        return PyErr_Format(PyExc_ValueError, "wake_fd %ld is not a descriptor or -1", fd);
    }
    const uint64_t one = 1;
    int write_errno = 0;
    if (PyList_GET_SIZE(self->items) > 0) {  /* no wait: os.eventfd_write's write, then it */
        if (fd >= 0) {
            Py_BEGIN_ALLOW_THREADS
            if (write((int)fd, &one, sizeof one) < 0) {
                write_errno = errno;
            }
            Py_END_ALLOW_THREADS
        }
    }
    else {
        self->waiting = 1;
        Py_BEGIN_ALLOW_THREADS
        if (fd >= 0 && write((int)fd, &one, sizeof one) < 0) {
            write_errno = errno;
        }
        if (!write_errno) {
            wait_posted(self);
        }
        Py_END_ALLOW_THREADS
        if (write_errno) {
            if (!self->waiting) {  /* a put posted meanwhile: take its post, keep its item */
                Py_BEGIN_ALLOW_THREADS
                wait_posted(self);
                Py_END_ALLOW_THREADS
            }
            self->waiting = 0;
        }
    }
    if (write_errno) {
        errno = write_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return take_first(self);
}

static int CallQueue_traverse(CallQueue *self, visitproc visit, void *arg)
{
    Py_VISIT(self->items);
    return 0;
}

static int CallQueue_clear(CallQueue *self)
{
    Py_CLEAR(self->items);
    return 0;
}

static void CallQueue_dealloc(CallQueue *self)
{
    PyObject_GC_UnTrack(self);
    CallQueue_clear(self);
    sem_destroy(&self->sem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef CallQueue_methods[] = {
    {"put", (PyCFunction)CallQueue_put, METH_O,
     "put(item): queue ``item`` behind every item put before; wakes a waiting take."},
    {"take", (PyCFunction)CallQueue_take, METH_O,
     "take(wake_fd): add 1 to the eventfd ``wake_fd`` (-1: none), then the oldest item, "
     "waiting for one in the same release of the GIL."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CallQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "serverkit._call_queue.CallQueue",
    .tp_basicsize = sizeof(CallQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An IoThread's calls (new_call_queue).",
    .tp_traverse = (traverseproc)CallQueue_traverse,
    .tp_clear = (inquiry)CallQueue_clear,
    .tp_dealloc = (destructor)CallQueue_dealloc,
    .tp_methods = CallQueue_methods,
};

static PyObject *new_call_queue(PyObject *module, PyObject *unused)
{
    CallQueue *self = PyObject_GC_New(CallQueue, &CallQueueType);
    if (self == NULL) {
        return NULL;
    }
    self->waiting = 0;
    self->items = PyList_New(0);
    if (self->items == NULL) {
        PyObject_GC_Del(self);
        return NULL;
    }
    if (sem_init(&self->sem, 0, 0) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_CLEAR(self->items);
        PyObject_GC_Del(self);
        return NULL;
    }
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyMethodDef module_methods[] = {
    {"new_call_queue", new_call_queue, METH_NOARGS,
     "new_call_queue() -> an empty queue of an IoThread's calls (put, take)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "serverkit._call_queue",
    "The C twin of serverkit.io_thread.CallQueuePython.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__call_queue(void)
{
    if (PyType_Ready(&CallQueueType) < 0) {
        return NULL;
    }
    return PyModule_Create(&module);
}
