/* delayserver._commit_codecs: the C twins of the delay store's commit encoders,
 * delayserver.storage.delay_record.encode_delay_records_python and
 * delayserver.storage.schedule_entry.encode_schedule_entries_python (optional; the pure-Python
 * ones are used where this is not built, and a Hypothesis test holds both byte for byte equal,
 * tests/unit/test_commit_codecs.py).
 *
 * encode_delay_records(deliver_at_ms, bucket_ms, message_ids_bytes, subject_tails, payloads)
 *     -> list of bytes: per row, u64 deliver_at_ms, u64 bucket_ms, u16 id length, the id bytes,
 *        the subject tail (u16 length and bytes, as delay_record.subject_tail gives it), the
 *        payload; big-endian (docs/FORMATS.md, the delay-log record).
 * frame_delay_records(deliver_at_ms, bucket_ms, message_ids_bytes, subject_tails, payloads)
 *     -> (framed, sizes, id_hashes): the same records framed as logstore records back to back
 *        in ONE bytes object (logstore/_framing.h's frame: what frame_records makes of the
 *        bodies above), each record's body size, and the CRC-32 of each message id (the
 *        schedule entry's id_hash): the delay store's append_many, one pass and one copy of
 *        every byte, no bytes object per record.
 * encode_schedule_entries(deliver_at_ms, delay_log_offsets, sizes_bytes, id_hashes)
 *     -> list of bytes: per row the 32-byte schedule entry (u64, u64, u32, u32, magic 0x5345,
 *        version 1, reserved 0, CRC-32 of bytes 0..27).
 *
 * Like the Python twins (map and zip), the answer has as many rows as the shortest column.
 * A value outside its field (negative, too large, not an int) raises OverflowError or
 * TypeError where the Python twins raise struct.error: the store checks the ranges before it
 * calls either, so neither raises there.
 *
 * Why C: a group commit of 32 sends spent ~0.9 us per row in these two encoders on the delay
 * server's delay-io thread (C-level passes of struct.pack, bytes.join and zlib.crc32, but one
 * bytes object and several tuples per step); here a column costs one call. CRC-32 is zlib's
 * (the same function as Python's zlib.crc32).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <zlib.h>

#include "../logstore/_framing.h"

#define DELAY_FIXED_BYTES 18     /* delay_record.FIXED: u64 deliver_at, u64 bucket, u16 id length */
#define ENTRY_HEAD_BYTES 28      /* schedule_entry.FIELDS */
#define ENTRY_BYTES 32           /* schedule_entry.ENTRY_SIZE_BYTES */
#define ENTRY_MAGIC 0x5345
#define ENTRY_VERSION 1

static void store_be64(unsigned char *p, uint64_t value)
{
    for (int i = 7; i >= 0; i--) {
        p[i] = (unsigned char)(value & 0xFF);
        value >>= 8;
    }
}

static void store_be32(unsigned char *p, uint32_t value)
{
    p[0] = (unsigned char)(value >> 24);
    p[1] = (unsigned char)(value >> 16);
    p[2] = (unsigned char)(value >> 8);
    p[3] = (unsigned char)value;
}

static void store_be16(unsigned char *p, unsigned int value)
{
    p[0] = (unsigned char)(value >> 8);
    p[1] = (unsigned char)value;
}

/* Item k of a list or tuple (from PySequence_Fast) as an unsigned integer of at most ``max``;
 * -1 with an error set when it is not an int or is outside [0, max]. */
static int item_unsigned(PyObject *fast, Py_ssize_t k, uint64_t max, const char *field,
                         uint64_t *value)
{
    PyObject *item = PySequence_Fast_GET_ITEM(fast, k);
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "%s of row %zd is a %s, not an int", field, k,
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "%s of row %zd is outside [0, %llu]", field, k,
                     (unsigned long long)max);
        return -1;
    }
    if (v > max) {
        PyErr_Format(PyExc_OverflowError, "%s %llu of row %zd is outside [0, %llu]", field, v,
                     k, (unsigned long long)max);
        return -1;
    }
    *value = (uint64_t)v;
    return 0;
}

#define COLUMNS_MAX 5  /* the most columns an encoder takes */

/* One row's encoding from the columns (PySequence_Fast lists or tuples); NULL with an error. */
typedef PyObject *(*encode_row)(PyObject **columns, Py_ssize_t k);

/* The list of ``row(columns, k)`` for every row of the ``count`` columns given as ``args``
 * (as many rows as the shortest column); NULL with an error, nothing leaked. */
static PyObject *encode_columns(PyObject *args, Py_ssize_t count, const char *name,
                                encode_row row)
{
    assert(count <= COLUMNS_MAX);
    if (PyTuple_GET_SIZE(args) != count) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd columns, %zd given", name, count,
                     PyTuple_GET_SIZE(args));
        return NULL;
    }
    PyObject *columns[COLUMNS_MAX];
    Py_ssize_t made = 0, rows = PY_SSIZE_T_MAX;
    PyObject *out = NULL;
    for (; made < count; made++) {
        columns[made] = PySequence_Fast(PyTuple_GET_ITEM(args, made),
                                        "a column must be a sequence");
        if (columns[made] == NULL) {
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(columns[made]) < rows) {
            rows = PySequence_Fast_GET_SIZE(columns[made]);
        }
    }
    out = PyList_New(rows);
    for (Py_ssize_t k = 0; out != NULL && k < rows; k++) {
        PyObject *encoded = row(columns, k);
        if (encoded == NULL) {
            Py_CLEAR(out);  /* the rows set so far go with it; the unset slots are NULL */
        } else {
            PyList_SET_ITEM(out, k, encoded);
        }
    }
done:
    for (Py_ssize_t c = 0; c < made; c++) {
        Py_DECREF(columns[c]);
    }
    return out;
}

/* Row k of encode_delay_records: the fixed fields, then the id, the subject tail and the
 * payload copied from their buffers. */
static PyObject *delay_row(PyObject **columns, Py_ssize_t k)
{
    uint64_t due, bucket;
    if (item_unsigned(columns[0], k, UINT64_MAX, "deliver_at_ms", &due) < 0
            || item_unsigned(columns[1], k, UINT64_MAX, "bucket_ms", &bucket) < 0) {
        return NULL;
    }
    Py_buffer parts[3];  /* the id, the subject tail, the payload */
    int held = 0;
    PyObject *body = NULL;
    for (; held < 3; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(columns[2 + held], k), &parts[held],
                               PyBUF_SIMPLE) < 0) {
            goto done;
        }
    }
    Py_ssize_t id_len = parts[0].len;
    if (id_len > 0xFFFF) {
        PyErr_Format(PyExc_OverflowError, "message id of row %zd has %zd bytes, more than %d",
                     k, id_len, 0xFFFF);
        goto done;
    }
    body = PyBytes_FromStringAndSize(
        NULL, DELAY_FIXED_BYTES + id_len + parts[1].len + parts[2].len);
    if (body == NULL) {
        goto done;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(body);
    store_be64(p, due);
    store_be64(p + 8, bucket);
    store_be16(p + 16, (unsigned int)id_len);
    p += DELAY_FIXED_BYTES;
    for (int i = 0; i < 3; i++) {
        memcpy(p, parts[i].buf, (size_t)parts[i].len);
        p += parts[i].len;
    }
done:
    while (held > 0) {
        PyBuffer_Release(&parts[--held]);
    }
    return body;
}

/* Row k of encode_schedule_entries: one 32-byte entry, its CRC over the first 28 bytes. */
static PyObject *entry_row(PyObject **columns, Py_ssize_t k)
{
    uint64_t due, offset, size, hash;
    if (item_unsigned(columns[0], k, UINT64_MAX, "deliver_at_ms", &due) < 0
            || item_unsigned(columns[1], k, UINT64_MAX, "delay_log_offset", &offset) < 0
            || item_unsigned(columns[2], k, UINT32_MAX, "size_bytes", &size) < 0
            || item_unsigned(columns[3], k, UINT32_MAX, "id_hash", &hash) < 0) {
        return NULL;
    }
    PyObject *entry = PyBytes_FromStringAndSize(NULL, ENTRY_BYTES);
    if (entry == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(entry);
    store_be64(p, due);
    store_be64(p + 8, offset);
    store_be32(p + 16, (uint32_t)size);
    store_be32(p + 20, (uint32_t)hash);
    store_be16(p + 24, ENTRY_MAGIC);
    p[26] = ENTRY_VERSION;
    p[27] = 0;
    store_be32(p + ENTRY_HEAD_BYTES, (uint32_t)crc32(0L, p, ENTRY_HEAD_BYTES));
    return entry;
}

static PyObject *encode_delay_records(PyObject *self, PyObject *args)
{
    return encode_columns(args, 5, "encode_delay_records", delay_row);
}

/* frame_delay_records: the columns' rows as framed delay-log records in one bytes object, their
 * body sizes and their ids' CRC-32s. Two passes: the first takes each row's buffers and checks
 * its fields (the errors of encode_delay_records, naming the row), the second writes every
 * record in place and frames it; every buffer is released whatever happens. */
static PyObject *frame_delay_records(PyObject *self, PyObject *args)
{
    if (PyTuple_GET_SIZE(args) != 5) {
        PyErr_Format(PyExc_TypeError, "frame_delay_records takes 5 columns, %zd given",
                     PyTuple_GET_SIZE(args));
        return NULL;
    }
    PyObject *columns[5];
    Py_ssize_t made = 0, rows = PY_SSIZE_T_MAX, held = 0;
    Py_buffer *parts = NULL;  /* 3 a row: the id, the subject tail, the payload */
    uint64_t *fixed = NULL;   /* 2 a row: deliver_at_ms, bucket_ms */
    PyObject *framed = NULL, *sizes = NULL, *hashes = NULL, *out = NULL;
    for (; made < 5; made++) {
        columns[made] = PySequence_Fast(PyTuple_GET_ITEM(args, made),
                                        "a column must be a sequence");
        if (columns[made] == NULL) {
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(columns[made]) < rows) {
            rows = PySequence_Fast_GET_SIZE(columns[made]);
        }
    }
    parts = PyMem_Malloc(sizeof(Py_buffer) * 3 * (size_t)(rows ? rows : 1));
    fixed = PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)(rows ? rows : 1));
    if (parts == NULL || fixed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t k = 0; k < rows; k++) {
        if (item_unsigned(columns[0], k, UINT64_MAX, "deliver_at_ms", &fixed[2 * k]) < 0
                || item_unsigned(columns[1], k, UINT64_MAX, "bucket_ms", &fixed[2 * k + 1]) < 0) {
            goto done;
        }
        for (int i = 0; i < 3; i++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(columns[2 + i], k),
                                   &parts[held], PyBUF_SIMPLE) < 0) {
                goto done;
            }
            held++;
        }
        Py_ssize_t id_len = parts[3 * k].len;
        if (id_len > 0xFFFF) {
            PyErr_Format(PyExc_OverflowError, "message id of row %zd has %zd bytes, more than %d",
                         k, id_len, 0xFFFF);
            goto done;
        }
        Py_ssize_t body = DELAY_FIXED_BYTES + id_len + parts[3 * k + 1].len + parts[3 * k + 2].len;
        if (body > (Py_ssize_t)UINT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "record of row %zd has %zd bytes, more than a "
                         "logstore record's u32 length holds", k, body);
            goto done;
        }
        total += LOGSTORE_HEADER_SIZE_BYTES + body;
    }
    framed = PyBytes_FromStringAndSize(NULL, total);
    sizes = PyList_New(rows);
    hashes = PyList_New(rows);
    if (framed == NULL || sizes == NULL || hashes == NULL) {
        goto done;
    }
    unsigned char *record = (unsigned char *)PyBytes_AS_STRING(framed);
    for (Py_ssize_t k = 0; k < rows; k++) {
        Py_buffer *row = &parts[3 * k];
        unsigned char *p = record + LOGSTORE_HEADER_SIZE_BYTES;
        store_be64(p, fixed[2 * k]);
        store_be64(p + 8, fixed[2 * k + 1]);
        store_be16(p + 16, (unsigned int)row[0].len);
        p += DELAY_FIXED_BYTES;
        for (int i = 0; i < 3; i++) {
            memcpy(p, row[i].buf, (size_t)row[i].len);
            p += row[i].len;
        }
        size_t body = (size_t)(p - record) - LOGSTORE_HEADER_SIZE_BYTES;
        logstore_frame_in_place(record, body);
        PyObject *size = PyLong_FromSize_t(body);
        PyObject *hash = PyLong_FromUnsignedLong(
            (unsigned long)crc32_z(0, (const unsigned char *)row[0].buf, (size_t)row[0].len));
        if (size == NULL || hash == NULL) {
            Py_XDECREF(size);
            Py_XDECREF(hash);
            goto done;
        }
        PyList_SET_ITEM(sizes, k, size);
        PyList_SET_ITEM(hashes, k, hash);
        record = p;
    }
    out = PyTuple_Pack(3, framed, sizes, hashes);
done:
    while (held > 0) {
        PyBuffer_Release(&parts[--held]);
    }
    PyMem_Free(parts);
    PyMem_Free(fixed);
    Py_XDECREF(framed);
    Py_XDECREF(sizes);
    Py_XDECREF(hashes);
    for (Py_ssize_t c = 0; c < made; c++) {
        Py_DECREF(columns[c]);
    }
    return out;
}

static PyObject *encode_schedule_entries(PyObject *self, PyObject *args)
{
    return encode_columns(args, 4, "encode_schedule_entries", entry_row);
}

static PyMethodDef methods[] = {
    {"encode_delay_records", encode_delay_records, METH_VARARGS,
     "encode_delay_records(deliver_at_ms, bucket_ms, message_ids_bytes, subject_tails, "
     "payloads) -> list of delay-log record bodies."},
    {"frame_delay_records", frame_delay_records, METH_VARARGS,
     "frame_delay_records(deliver_at_ms, bucket_ms, message_ids_bytes, subject_tails, "
     "payloads) -> (framed records as one bytes, body sizes, id CRC-32s)."},
    {"encode_schedule_entries", encode_schedule_entries, METH_VARARGS,
     "encode_schedule_entries(deliver_at_ms, delay_log_offsets, sizes_bytes, id_hashes) -> "
     "list of 32-byte schedule entries."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "delayserver._commit_codecs",
    "C twins of the delay store's commit encoders (optional speed-up).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__commit_codecs(void)
{
    return PyModule_Create(&module);
}
