/* delayserver._due_records: the C twin of delayserver.storage.due_records.parse_due_run_python
 * (optional; the pure-Python one is used where this is not built, and both are tested to give
 * the same answers on normal and malformed input, tests/unit/test_due_records.py).
 *
 * parse_due_run(data, ats, sizes, deliver_at_ms, bucket_ms, id_hashes, record_size_bytes_max)
 *     -> list of (subject: str, payload: bytes) or None
 *
 * For each k, the record whose logstore header starts at byte ats[k] of ``data`` and whose body
 * has sizes[k] bytes: checked like SegmentedLog.read (length, magic 0x514D, version 1, CRC-32 over
 * header bytes 0..3, 8..11 and the body; attributes are not checked), then parsed as a delay
 * record (delay_record.py) and checked against its schedule entry: deliver_at_ms and bucket_ms
 * equal, an id of at least one byte whose CRC-32 is id_hashes[k], a subject of at least one byte
 * of UTF-8. None where anything fails: the caller reads that record alone for the exact error.
 *
 * Why C: dispatching a hot second of 100,000 messages read and checked every record in Python
 * (~2.5 us each, the largest share of the delay server's CPU per message); here a run of records
 * costs one call. CRC-32 is zlib's (the same function as Python's zlib.crc32).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <zlib.h>

#define LOG_HEADER_BYTES 12   /* logstore.record.HEADER: u32 length, u32 crc, u16 magic, u8, u8 */
#define LOG_MAGIC 0x514D
#define LOG_VERSION 1
#define DELAY_FIXED_BYTES 18  /* delay_record.FIXED: u64 deliver_at, u64 bucket, u16 id length */
#define DELAY_MIN_BODY_BYTES 20

static uint64_t load_be64(const unsigned char *p)
{
    uint64_t value = 0;
    for (int i = 0; i < 8; i++) {
        value = (value << 8) | p[i];
    }
    return value;
}

static uint32_t load_be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static unsigned int load_be16(const unsigned char *p)
{
    return ((unsigned int)p[0] << 8) | p[1];
}

/* An item of a list as a non-negative integer of at most 64 bits; -1 with no error set when it
 * is not one (negative, too large, not an int), -2 with an error set on a failure of ours. */
static int item_u64(PyObject *list, Py_ssize_t k, uint64_t *value)
{
    PyObject *item = PyList_GET_ITEM(list, k);
    if (!PyLong_Check(item)) {
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            return -1;
        }
        return -2;
    }
    *value = (uint64_t)v;
    return 0;
}

/* The parsed record k, a new reference: a (subject, payload) tuple, Py_None when a check fails,
 * NULL with an error set on a failure of ours (memory). */
static PyObject *parse_one(const unsigned char *data, Py_ssize_t data_size, int64_t at,
                           uint64_t size, uint64_t due, uint64_t bucket, uint64_t id_hash,
                           uint64_t record_size_max)
{
    if (at < 0 || size > record_size_max || size > (uint64_t)data_size
            || (uint64_t)at > (uint64_t)data_size
            || (uint64_t)at + LOG_HEADER_BYTES + size > (uint64_t)data_size) {
        Py_RETURN_NONE;
    }
    const unsigned char *header = data + at;
    const unsigned char *body = header + LOG_HEADER_BYTES;
    if (load_be32(header) != size || load_be16(header + 8) != LOG_MAGIC
            || header[10] != LOG_VERSION) {
        Py_RETURN_NONE;
    }
    uLong crc = crc32(0L, header, 4);
    crc = crc32(crc, header + 8, 4);
    crc = crc32(crc, body, (uInt)size);
    if ((uint32_t)crc != load_be32(header + 4) || size < DELAY_MIN_BODY_BYTES) {
        Py_RETURN_NONE;
    }
    uint64_t id_length = load_be16(body + 16);
    uint64_t subject_length_at = DELAY_FIXED_BYTES + id_length;
    if (load_be64(body) != due || load_be64(body + 8) != bucket || id_length == 0
            || subject_length_at + 2 > size) {
        Py_RETURN_NONE;
    }
    uint64_t subject_length = load_be16(body + subject_length_at);
    uint64_t payload_at = subject_length_at + 2 + subject_length;
    if (subject_length == 0 || payload_at > size
            || (uint32_t)crc32(0L, body + DELAY_FIXED_BYTES, (uInt)id_length) != id_hash) {
        Py_RETURN_NONE;
    }
    PyObject *subject = PyUnicode_DecodeUTF8((const char *)body + subject_length_at + 2,
                                             (Py_ssize_t)subject_length, "strict");
    if (subject == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        return NULL;
    }
    PyObject *payload = PyBytes_FromStringAndSize((const char *)body + payload_at,
                                                  (Py_ssize_t)(size - payload_at));
    if (payload == NULL) {
        Py_DECREF(subject);
        return NULL;
    }
    PyObject *pair = PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(subject);
        Py_DECREF(payload);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, subject);
    PyTuple_SET_ITEM(pair, 1, payload);
    return pair;
}

static PyObject *parse_due_run(PyObject *self, PyObject *args)
{
    Py_buffer data;
    PyObject *lists[5]; /* ats, sizes, deliver_at_ms, bucket_ms, id_hashes */
    unsigned long long record_size_max;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!O!O!O!O!K", &data, &PyList_Type, &lists[0], &PyList_Type,
                          &lists[1], &PyList_Type, &lists[2], &PyList_Type, &lists[3],
                          &PyList_Type, &lists[4], &record_size_max)) {
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(lists[0]);
    for (int l = 1; l < 5; l++) {
        if (PyList_GET_SIZE(lists[l]) < count) {
            count = PyList_GET_SIZE(lists[l]);  /* zip semantics: the shortest list */
        }
    }
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *item = NULL;
        /* parse_one allocates tuples, which can run the garbage collector and so any
         * finalizer, which could shrink a list: look at the sizes again each time. */
        for (int l = 0; l < 5; l++) {
            if (PyList_GET_SIZE(lists[l]) <= k) {
                PyErr_SetString(PyExc_RuntimeError, "a list changed size during parse_due_run");
                goto fail;
            }
        }
        PyObject *at_object = PyList_GET_ITEM(lists[0], k);
        uint64_t fields[4]; /* size, due, bucket, id hash */
        int bad = 0;
        long long at = PyLong_Check(at_object) ? PyLong_AsLongLong(at_object) : -1;
        if (at == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                goto fail;
            }
            PyErr_Clear();
            bad = 1;
        }
        for (int l = 1; l < 5 && !bad; l++) {
            int got = item_u64(lists[l], k, &fields[l - 1]);
            if (got == -2) {
                goto fail;
            }
            bad = got == -1;
        }
        if (bad) {
            Py_INCREF(Py_None);
            item = Py_None;
        } else {
            item = parse_one((const unsigned char *)data.buf, data.len, (int64_t)at, fields[0],
                             fields[1], fields[2], fields[3], (uint64_t)record_size_max);
            if (item == NULL) {
                goto fail;
            }
        }
        PyList_SET_ITEM(out, k, item);
    }
    PyBuffer_Release(&data);
    return out;
fail:
    PyBuffer_Release(&data);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"parse_due_run", parse_due_run, METH_VARARGS,
     "parse_due_run(data, ats, sizes, deliver_at_ms, bucket_ms, id_hashes, "
     "record_size_bytes_max) -> list of (subject, payload) or None (read that one alone)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "delayserver._due_records",
    "C twin of delayserver.storage.due_records.parse_due_run_python (optional speed-up).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__due_records(void)
{
    return PyModule_Create(&module);
}
