/* logstore._framing: the C twin of logstore.record.frame_records (optional speed-up).
 *
 * frame_records(bodies: list[bytes]) -> bytes frames every body as one logstore record, back to
 * back, exactly as record.encode_record does (the layout table is in logstore/record.py):
 *
 *     u32 body_length | u32 crc32 | u16 magic 0x514D | u8 version 1 | u8 attributes 0 | body
 *
 * all big-endian, the CRC being zlib's CRC-32 over bytes 0..3 and 8..end (this links zlib and calls
 * its crc32, like delayserver/_due_records.c and realtime/storage/_codecs.c; the frame itself is
 * written by _framing.h, which realtime/storage/_codecs.c's encode_run shares). Why C: a log
 * append is dominated by per-record Python calls (length, CRC, header pack, join); here they
 * cost one loop iteration. record.py falls back to the pure-Python frame_records when this
 * module was not built, and the codec tests check both against zlib.crc32.
 *
 * write_sync(fd: int, data: bytes, offset: int) -> (written, write_errno, fsync_errno, fsync_ns,
 * synced_at_ns) writes all of data at offset (looping over short writes), then fdatasyncs fd, with
 * the GIL released once for both (logstore.fileio.OsFile.append_and_sync). Why: a group commit
 * released and took back the GIL around its pwrite and again around its fsync; each take-back
 * waits for the event loop thread to let go when it runs Python meanwhile. It raises nothing
 * for an OS error: write_errno is set (and fsync skipped) when a pwrite failed after `written`
 * bytes, fsync_errno when the fsync failed; fsync_ns is the fsync's own CLOCK_MONOTONIC time
 * (no GIL wait in it) and synced_at_ns the CLOCK_MONOTONIC ns when it returned (what a probe
 * compares with the moment Python runs again: the wait for the GIL).
 *
 * write_sync(fd, data, offset, then_fd, then_data, then_offset) -> the same and (then_written,
 * then_errno): after a good fsync, also writes then_data at then_offset of then_fd in the same
 * release (a commit's consumer-log entries, written once their records are durable). The
 * write itself is _framing.h's logstore_write_sync_released, which realtime/storage/_codecs.c's
 * write_run shares.
 *
 * split_records(data, record_size_bytes_max) -> (bodies, used, problem) checks the whole records
 * at the start of bytes copied from a log (replication: a slave's append of a fetched chunk, a
 * master's read of one), as logstore.record.split_records does, bodies as bytes. Why: the
 * Python twin makes ~8 calls and three crc32 calls a record, about half of a slave's CPU per
 * copied commit (docs/BENCHMARKS.md, session 20).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "_framing.h"

#define HEADER_SIZE_BYTES LOGSTORE_HEADER_SIZE_BYTES

static PyObject *frame_records(PyObject *module, PyObject *bodies)
{
    (void)module;
    if (!PyList_Check(bodies)) {
        PyErr_Format(PyExc_TypeError, "bodies must be a list, not %.100s",
                     Py_TYPE(bodies)->tp_name);
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(bodies);
    Py_ssize_t total_bytes = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *body = PyList_GET_ITEM(bodies, i);
        if (!PyBytes_Check(body)) {
            PyErr_Format(PyExc_TypeError, "body %zd is %.100s, not bytes", i,
                         Py_TYPE(body)->tp_name);
            return NULL;
        }
        Py_ssize_t size = PyBytes_GET_SIZE(body);
        if ((uint64_t)size > UINT32_MAX
            || total_bytes > PY_SSIZE_T_MAX - HEADER_SIZE_BYTES - size) {
            PyErr_Format(PyExc_OverflowError, "body %zd of %zd bytes does not fit a record", i,
                         size);
            return NULL;
        }
        total_bytes += HEADER_SIZE_BYTES + size;
    }
    PyObject *framed = PyBytes_FromStringAndSize(NULL, total_bytes);
    if (framed == NULL) {
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(framed);
    /* No Python code runs in this loop, so the list cannot change under it. */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *body = PyList_GET_ITEM(bodies, i);
        Py_ssize_t size = PyBytes_GET_SIZE(body);
        memcpy(out + HEADER_SIZE_BYTES, PyBytes_AS_STRING(body), (size_t)size);
        logstore_frame_in_place(out, (size_t)size);
        out += HEADER_SIZE_BYTES + size;
    }
    return framed;
}

static uint32_t load_be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* split_records(data, record_size_bytes_max) -> (bodies: list[bytes], used, problem | None):
 * logstore.record.split_records_python's answers (the same checks in the same order and the same
 * problem texts), each body a bytes copy instead of a memoryview. */
static PyObject *split_records(PyObject *module, PyObject *args)
{
    (void)module;
    Py_buffer data;
    long long record_size_bytes_max;
    if (!PyArg_ParseTuple(args, "y*L:split_records", &data, &record_size_bytes_max)) {
        return NULL;
    }
    const unsigned char *bytes = (const unsigned char *)data.buf;
    Py_ssize_t size = data.len;
    Py_ssize_t at = 0;
    int bad = 0;
    PyObject *problem = NULL;
    PyObject *bodies = PyList_New(0);
    if (bodies == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    while (size - at >= HEADER_SIZE_BYTES) {
        const unsigned char *header = bytes + at;
        uint32_t body_length = load_be32(header);
        uint32_t crc = load_be32(header + 4);
        unsigned int magic = ((unsigned int)header[8] << 8) | header[9];
        bad = 1; /* problem may be NULL with an error set when its text could not be made */
        if (magic != 0x514D) {
            problem = PyUnicode_FromFormat("bad magic 0x%04x", magic);
        } else if (header[10] != 1) {
            problem = PyUnicode_FromFormat("unknown version %d", (int)header[10]);
        } else if ((long long)body_length > record_size_bytes_max) {
            problem = PyUnicode_FromFormat(
                "stored length %lu exceeds record_size_bytes_max %lld",
                (unsigned long)body_length, record_size_bytes_max);
        } else if (header[11] != 0) {
            problem = PyUnicode_FromFormat("attributes 0x%02x are not 0", (int)header[11]);
        } else {
            bad = 0;
        }
        if (bad) {
            break;
        }
        if ((Py_ssize_t)body_length > size - at - HEADER_SIZE_BYTES) {
            break; /* a partial record: the caller asked for a byte budget */
        }
        uint32_t computed = (uint32_t)crc32_z(0, header, 4);
        computed = (uint32_t)crc32_z(computed, header + 8, 4 + (size_t)body_length);
        if (computed != crc) {
            problem = PyUnicode_FromString("crc mismatch");
            bad = 1;
            break;
        }
        PyObject *body = PyBytes_FromStringAndSize(
            (const char *)header + HEADER_SIZE_BYTES, (Py_ssize_t)body_length);
        if (body == NULL || PyList_Append(bodies, body) < 0) {
            Py_XDECREF(body);
            Py_DECREF(bodies);
            PyBuffer_Release(&data);
            return NULL;
        }
        Py_DECREF(body);
        at += HEADER_SIZE_BYTES + (Py_ssize_t)body_length;
    }
    PyBuffer_Release(&data);
    if (bad && problem == NULL) { /* a problem text that could not be made */
        Py_DECREF(bodies);
        return NULL;
    }
    if (problem == NULL) {
        Py_INCREF(Py_None);
        problem = Py_None;
    }
    return Py_BuildValue("(NnN)", bodies, at, problem);
}

static PyObject *write_sync(PyObject *module, PyObject *args)
{
    (void)module;
    int fd;
    int then_fd = -1;
    Py_buffer data;
    Py_buffer then_data = {0};
    long long offset;
    long long then_offset = 0;
    if (!PyArg_ParseTuple(args, "iy*L|iy*L:write_sync", &fd, &data, &offset, &then_fd,
                          &then_data, &then_offset)) {
        return NULL;
    }
    if (offset < 0 || then_offset < 0) {
        PyBuffer_Release(&data);
        if (then_data.obj != NULL) {
            PyBuffer_Release(&then_data);
        }
        PyErr_Format(PyExc_ValueError, "offsets %lld, %lld: one is negative", offset,
                     then_offset);
        return NULL;
    }
    struct logstore_sync_write w = {
        .fd = fd, .data = (const char *)data.buf, .size = data.len, .offset = offset,
        .then_fd = then_fd, .then_data = (const char *)then_data.buf,
        .then_size = then_data.len, .then_offset = then_offset,
    };
    /* The buffers stay valid until PyBuffer_Release (y* keeps their objects alive): nothing
     * here touches a Python object while the GIL is released. */
    Py_BEGIN_ALLOW_THREADS
    logstore_write_sync_released(&w);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (then_data.obj != NULL) {
        PyBuffer_Release(&then_data);
        return Py_BuildValue("(niiLLni)", w.written, w.write_errno, w.fsync_errno, w.fsync_ns,
                             w.synced_at_ns, w.then_written, w.then_errno);
    }
    return Py_BuildValue("(niiLL)", w.written, w.write_errno, w.fsync_errno, w.fsync_ns,
                         w.synced_at_ns);
}

static PyMethodDef framing_methods[] = {
    {"frame_records", frame_records, METH_O,
     "frame_records(bodies: list[bytes]) -> bytes\n\n"
     "Frame every body as a logstore record, back to back (the same bytes as\n"
     "logstore.record.encode_record on each, joined)."},
    {"split_records", split_records, METH_VARARGS,
     "split_records(data: bytes-like, record_size_bytes_max: int)\n"
     "-> (bodies: list[bytes], used: int, problem: str | None)\n\n"
     "Check the whole records at the start of data, as logstore.record.split_records does."},
    {"write_sync", write_sync, METH_VARARGS,
     "write_sync(fd: int, data: bytes, offset: int[, then_fd: int, then_data: bytes,\n"
     "then_offset: int]) -> (written, write_errno, fsync_errno, fsync_ns, synced_at_ns\n"
     "[, then_written, then_errno])\n\n"
     "pwrite all of data at offset, then fdatasync fd (then, after a good one, pwrite\n"
     "then_data at then_offset of then_fd), with the GIL released once for all;\n"
     "an OS error is returned as its errno, not raised."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef framing_module = {
    PyModuleDef_HEAD_INIT,
    "logstore._framing",
    "C twins of logstore.record.frame_records and split_records (see logstore/_framing.c).",
    -1, /* no per-module state */
    framing_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__framing(void)
{
    return PyModule_Create(&framing_module);
}
