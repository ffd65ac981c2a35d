/* realtime.storage._codecs: C twins of the batch encoders of the realtime store (optional).
 *
 * encode_entries(timestamps_ms, message_log_offsets, sizes_bytes, tag_blooms) -> bytes
 *     consumer_log.encode_entries: per entry, big-endian u64 timestamp_ms, u64 offset,
 *     u32 size, u64 tag_bloom, then u32 CRC-32 (zlib) of those 28 bytes.
 * encode_subject_records(timestamp_ms, subject_utf8, sequences, tag_blooms, ids_utf8,
 *                        payloads) -> list[bytes]
 *     message_record.encode_subject_records once the subject is UTF-8: per record, u64
 *     timestamp_ms, u64 sequence, u64 tag_bloom, u16 subject length, the subject, u16 id length,
 *     the id, the payload.
 * encode_visible_records(timestamp_ms, subject_utf8, sequences, tag_blooms, held_offsets,
 *                        ids_utf8, payloads) -> list[bytes]
 *     control_record.encode_visible_messages once the subject is UTF-8: per record, u64
 *     timestamp_ms, u64 sequence, u64 tag_bloom, u16 marker 0, u8 kind 4, u64 held_offset,
 *     then as above from the u16 subject length on.
 *
 * check_run, encode_run and write_run (the broker's usual commit in one call) are in
 * realtime/storage/_run_codec.h, included below, with their own description.
 *
 * encode_held_entries(held) -> bytes
 *     store_checkpoint.encode_held_entries: per held entry (a 6-tuple: held_offset, size_bytes,
 *     visible_at_ms, tag_bloom, subject, message_id), u64 held_offset, u32 size_bytes, u64
 *     visible_at_ms, u64 tag_bloom, u16 subject length, the subject UTF-8, u16 id length, the id.
 * decode_message_headers(bodies) -> (timestamps_ms, sequences, tag_blooms, subjects,
 *                                   message_ids) | None
 *     message_record.decode_message_headers, the one decoder here: the fields before the payload
 *     of every message record body of a list of bytes, column by column; None when the list is
 *     empty, holds anything but bytes, or one body is not a valid message record (shorter than
 *     28 bytes, subject length 0 (a control record), a length past the body, a subject or id
 *     not UTF-8). A subject equal to the previous record's is the same str (one decode per run
 *     of a subject). A slave's copy of every commit of the master's message log runs it.
 *
 * The layouts are documented in consumer_log.py, message_record.py, control_record.py and
 * store_checkpoint.py, which hold the pure-Python twins; the first three take lists only (the
 * Python wrappers fall back to the twins for anything else), encode_held_entries any sequence
 * of tuples of str names (a TypeError sends the wrapper to its twin).
 * A value out of its field's width raises ValueError as the twins do; a value that is not an int
 * (one with ``__index__``, a float, ...) raises TypeError, and the Python wrappers then call the
 * twins, which word the error or take the int-like value.
 * Why C: a commit encodes every message's record and entry; even as C-level maps the Python
 * twins spend most of their time in per-item call overhead (three struct/CRC calls per entry).
 * A checkpoint encodes the whole held set (200,000 entries: ~190 ms in Python, on the store
 * thread that sends wait for).
 * tests/unit/test_realtime_storage_codecs.py holds both to the same bytes and the same errors.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "../../logstore/_framing.h"

#define ENTRY_HEAD_BYTES 28
#define ENTRY_BYTES 32
#define RECORD_FIXED_BYTES 26 /* timestamp, sequence, bloom, subject length */
#define VISIBLE_FIXED_BYTES 37 /* timestamp, sequence, bloom, marker, kind, held offset,
                                  subject length */
#define KIND_VISIBLE_MESSAGE 4
#define HELD_HEAD_BYTES 28 /* held_offset, size_bytes, visible_at_ms, tag_bloom */

/* zlib.crc32(data): zlib's own crc32, as in the other C twins. */
static uint32_t crc32_of(const unsigned char *data, size_t size)
{
    return (uint32_t)crc32_z(0, data, size);
}

static void put_be(unsigned char *out, uint64_t value, int size)
{
    for (int i = size - 1; i >= 0; i--) {
        out[i] = (unsigned char)value;
        value >>= 8;
    }
}

/* The big-endian unsigned of ``size`` bytes at ``data``. */
static uint64_t get_be(const unsigned char *data, int size)
{
    uint64_t value = 0;
    for (int i = 0; i < size; i++) {
        value = (value << 8) | data[i];
    }
    return value;
}

/* The int at ``list[index]`` (a list or a tuple) as an unsigned of at most ``max``; -1 with
 * ValueError set when it is an int outside [0, max], TypeError when it is not an int. No
 * Python code runs here (an int-like object's ``__index__`` could change the list this loop
 * reads borrowed items from: review rvbroker-3), so anything but an int is left to the Python
 * twins, which take ``__index__`` as struct.pack does: the wrappers fall back on TypeError. */
static int get_field(PyObject *list, Py_ssize_t index, uint64_t max, const char *name,
                     uint64_t *out)
{
    /* A list's item, or a tuple's (a held entry): both keep their items where
     * PySequence_Fast_ITEMS says. */
    PyObject *item = PySequence_Fast_ITEMS(list)[index];
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "%s field is not an int", name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(item);
    if (!(value == (unsigned long long)-1 && PyErr_Occurred()) && value <= max) {
        *out = value;
        return 0;
    }
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s field out of range: %R", name, item);
    return -1;
}

static int same_lengths(PyObject **lists, int count, Py_ssize_t *length)
{
    *length = PyList_GET_SIZE(lists[0]);
    for (int i = 1; i < count; i++) {
        if (PyList_GET_SIZE(lists[i]) != *length) {
            PyErr_SetString(PyExc_ValueError, "columns differ in length");
            return -1;
        }
    }
    return 0;
}

static PyObject *encode_entries(PyObject *module, PyObject *args)
{
    PyObject *columns[4];
    if (!PyArg_ParseTuple(args, "O!O!O!O!:encode_entries", &PyList_Type, &columns[0],
                          &PyList_Type, &columns[1], &PyList_Type, &columns[2], &PyList_Type,
                          &columns[3])) {
        return NULL;
    }
    Py_ssize_t count;
    if (same_lengths(columns, 4, &count) < 0) {
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * ENTRY_BYTES);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *at = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++, at += ENTRY_BYTES) {
        uint64_t timestamp, offset, size, bloom;
        if (get_field(columns[0], i, UINT64_MAX, "timestamp_ms", &timestamp) < 0
                || get_field(columns[1], i, UINT64_MAX, "message_log_offset", &offset) < 0
                || get_field(columns[2], i, UINT32_MAX, "size_bytes", &size) < 0
                || get_field(columns[3], i, UINT64_MAX, "tag_bloom", &bloom) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        put_be(at, timestamp, 8);
        put_be(at + 8, offset, 8);
        put_be(at + 16, size, 4);
        put_be(at + 20, bloom, 8);
        put_be(at + ENTRY_HEAD_BYTES, crc32_of(at, ENTRY_HEAD_BYTES), 4);
    }
    (void)module;
    return out;
}

/* The records of one subject given column by column: message records (``held_offsets`` NULL)
 * or visible-message records (``held_offsets`` the list of the held records' offsets). */
static PyObject *subject_records(PyObject *timestamp_object, const char *subject,
                                 Py_ssize_t subject_size, PyObject *sequences,
                                 PyObject *blooms, PyObject *held_offsets, PyObject *ids,
                                 PyObject *payloads)
{
    uint64_t timestamp;
    PyObject *columns[5] = {sequences, blooms, ids, payloads, held_offsets};
    Py_ssize_t count;
    if (same_lengths(columns, held_offsets == NULL ? 4 : 5, &count) < 0) {
        return NULL;
    }
    if (count == 0) {
        return PyList_New(0); /* as the twins: no record, so no field (timestamp_ms, the
                               * subject's size) to check */
    }
    if (subject_size > 0xFFFF) {
        PyErr_Format(PyExc_ValueError, "subject of %zd bytes exceeds 65535", subject_size);
        return NULL;
    }
    PyObject *holder = PyList_New(1); /* get_field reads from a list */
    if (holder == NULL) {
        return NULL;
    }
    Py_INCREF(timestamp_object);
    PyList_SET_ITEM(holder, 0, timestamp_object);
    int bad = get_field(holder, 0, UINT64_MAX, "timestamp_ms", &timestamp);
    Py_DECREF(holder);
    if (bad < 0) {
        return NULL;
    }
    Py_ssize_t fixed = held_offsets == NULL ? RECORD_FIXED_BYTES : VISIBLE_FIXED_BYTES;
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t sequence, bloom, held_offset = 0;
        PyObject *id = PyList_GET_ITEM(ids, i);
        PyObject *payload = PyList_GET_ITEM(payloads, i);
        if (get_field(sequences, i, UINT64_MAX, "subject_sequence", &sequence) < 0
                || get_field(blooms, i, UINT64_MAX, "tag_bloom", &bloom) < 0
                || (held_offsets != NULL
                    && get_field(held_offsets, i, UINT64_MAX, "held_offset", &held_offset) < 0)) {
            Py_DECREF(out);
            return NULL;
        }
        if (!PyBytes_Check(id) || !PyBytes_Check(payload)) {
            /* The Python twins take any bytes-like payload: their wrappers fall back to them. */
            PyErr_SetString(PyExc_TypeError, "message id and payload must be bytes");
            Py_DECREF(out);
            return NULL;
        }
        if (PyBytes_GET_SIZE(id) > 0xFFFF) {
            PyErr_Format(PyExc_ValueError, "message_id_length field out of range: %zd bytes",
                         PyBytes_GET_SIZE(id));
            Py_DECREF(out);
            return NULL;
        }
        Py_ssize_t id_size = PyBytes_GET_SIZE(id);
        Py_ssize_t payload_size = PyBytes_GET_SIZE(payload);
        PyObject *record = PyBytes_FromStringAndSize(
            NULL, fixed + subject_size + 2 + id_size + payload_size);
        if (record == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        unsigned char *at = (unsigned char *)PyBytes_AS_STRING(record);
        put_be(at, timestamp, 8);
        put_be(at + 8, sequence, 8);
        put_be(at + 16, bloom, 8);
        if (held_offsets != NULL) {
            put_be(at + 24, 0, 2); /* marker: 0, where a message record has its subject length */
            at[26] = KIND_VISIBLE_MESSAGE;
            put_be(at + 27, held_offset, 8);
        }
        put_be(at + fixed - 2, (uint64_t)subject_size, 2);
        at += fixed;
        memcpy(at, subject, subject_size);
        at += subject_size;
        put_be(at, (uint64_t)id_size, 2);
        memcpy(at + 2, PyBytes_AS_STRING(id), id_size);
        memcpy(at + 2 + id_size, PyBytes_AS_STRING(payload), payload_size);
        PyList_SET_ITEM(out, i, record);
    }
    return out;
}

static PyObject *encode_subject_records(PyObject *module, PyObject *args)
{
    PyObject *timestamp_object;
    const char *subject;
    Py_ssize_t subject_size;
    PyObject *columns[4]; /* sequences, tag blooms, ids (bytes), payloads (bytes) */
    if (!PyArg_ParseTuple(args, "Oy#O!O!O!O!:encode_subject_records", &timestamp_object,
                          &subject, &subject_size, &PyList_Type, &columns[0], &PyList_Type,
                          &columns[1], &PyList_Type, &columns[2], &PyList_Type, &columns[3])) {
        return NULL;
    }
    (void)module;
    return subject_records(timestamp_object, subject, subject_size, columns[0], columns[1],
                           NULL, columns[2], columns[3]);
}

static PyObject *encode_visible_records(PyObject *module, PyObject *args)
{
    PyObject *timestamp_object;
    const char *subject;
    Py_ssize_t subject_size;
    PyObject *columns[5]; /* sequences, tag blooms, held offsets, ids (bytes), payloads */
    if (!PyArg_ParseTuple(args, "Oy#O!O!O!O!O!:encode_visible_records", &timestamp_object,
                          &subject, &subject_size, &PyList_Type, &columns[0], &PyList_Type,
                          &columns[1], &PyList_Type, &columns[2], &PyList_Type, &columns[3],
                          &PyList_Type, &columns[4])) {
        return NULL;
    }
    (void)module;
    return subject_records(timestamp_object, subject, subject_size, columns[0], columns[1],
                           columns[2], columns[3], columns[4]);
}

/* The bytes of a UTF-8 name field: u16 length, then the bytes; -1 with TypeError when ``name``
 * is not a str (the wrapper's Python twin then words the error), ValueError past 65535 bytes. */
static const char *name_utf8(PyObject *name, Py_ssize_t *size)
{
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "held entry names must be str");
        return NULL;
    }
    const char *utf8 = PyUnicode_AsUTF8AndSize(name, size);
    if (utf8 != NULL && *size > 0xFFFF) {
        PyErr_Format(PyExc_ValueError, "held entry name of %zd bytes exceeds 65535", *size);
        return NULL;
    }
    return utf8;
}

static PyObject *encode_held_entries(PyObject *module, PyObject *held)
{
    PyObject *items = PySequence_Fast(held, "held entries must be a sequence");
    if (items == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    PyObject **entries = PySequence_Fast_ITEMS(items);
    /* Two passes: the size first (names are UTF-8 once, cached by str), then the bytes. */
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = entries[i];
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 6) {
            PyErr_SetString(PyExc_TypeError, "a held entry must be a tuple of 6 fields");
            Py_DECREF(items);
            return NULL;
        }
        Py_ssize_t subject_size, id_size;
        if (name_utf8(PyTuple_GET_ITEM(entry, 4), &subject_size) == NULL
                || name_utf8(PyTuple_GET_ITEM(entry, 5), &id_size) == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        total += HELD_HEAD_BYTES + 2 + subject_size + 2 + id_size;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        Py_DECREF(items);
        return NULL;
    }
    unsigned char *at = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = entries[i];
        uint64_t offset, size, visible_at, bloom;
        Py_ssize_t subject_size, id_size;
        if (get_field(entry, 0, UINT64_MAX, "held_offset", &offset) < 0
                || get_field(entry, 1, UINT32_MAX, "size_bytes", &size) < 0
                || get_field(entry, 2, UINT64_MAX, "visible_at_ms", &visible_at) < 0
                || get_field(entry, 3, UINT64_MAX, "tag_bloom", &bloom) < 0) {
            Py_DECREF(out);
            Py_DECREF(items);
            return NULL;
        }
        const char *subject = name_utf8(PyTuple_GET_ITEM(entry, 4), &subject_size);
        const char *id = name_utf8(PyTuple_GET_ITEM(entry, 5), &id_size);
        put_be(at, offset, 8);
        put_be(at + 8, size, 4);
        put_be(at + 12, visible_at, 8);
        put_be(at + 20, bloom, 8);
        at += HELD_HEAD_BYTES;
        put_be(at, (uint64_t)subject_size, 2);
        memcpy(at + 2, subject, subject_size);
        at += 2 + subject_size;
        put_be(at, (uint64_t)id_size, 2);
        memcpy(at + 2, id, id_size);
        at += 2 + id_size;
    }
    Py_DECREF(items);
    (void)module;
    return out;
}

/* message_record.decode_message_headers (the module comment). */
static PyObject *decode_message_headers(PyObject *module, PyObject *bodies)
{
    if (!PyList_CheckExact(bodies) || PyList_GET_SIZE(bodies) == 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t count = PyList_GET_SIZE(bodies);
    PyObject *columns[5] = {NULL, NULL, NULL, NULL, NULL};
    PyObject *result = NULL;
    const char *last_subject = NULL; /* the previous record's raw subject, in its body */
    Py_ssize_t last_subject_bytes = -1;
    PyObject *subject = NULL; /* its str (borrowed from the subjects column) */
    for (int c = 0; c < 5; c++) {
        if ((columns[c] = PyList_New(count)) == NULL) {
            goto done;
        }
    }
    /* Every item is checked before any is read: a body that is not bytes means None. */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyBytes_CheckExact(PyList_GET_ITEM(bodies, i))) {
            goto invalid;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *body = PyList_GET_ITEM(bodies, i);
        const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(body);
        Py_ssize_t size = PyBytes_GET_SIZE(body);
        if (size < RECORD_FIXED_BYTES + 2) {
            goto invalid;
        }
        Py_ssize_t subject_bytes = (Py_ssize_t)get_be(data + 24, 2);
        if (subject_bytes == 0) { /* a control record's marker */
            goto invalid;
        }
        Py_ssize_t id_at = RECORD_FIXED_BYTES + subject_bytes;
        if (id_at + 2 > size) {
            goto invalid;
        }
        Py_ssize_t id_bytes = (Py_ssize_t)get_be(data + id_at, 2);
        if (id_at + 2 + id_bytes > size) {
            goto invalid;
        }
        const char *raw_subject = (const char *)data + RECORD_FIXED_BYTES;
        if (subject == NULL || subject_bytes != last_subject_bytes
                || memcmp(raw_subject, last_subject, (size_t)subject_bytes) != 0) {
            subject = PyUnicode_DecodeUTF8(raw_subject, subject_bytes, "strict");
            if (subject == NULL) {
                goto decode_failed;
            }
            last_subject = raw_subject;
            last_subject_bytes = subject_bytes;
        } else {
            Py_INCREF(subject);
        }
        PyList_SET_ITEM(columns[3], i, subject);
        PyObject *message_id = PyUnicode_DecodeUTF8((const char *)data + id_at + 2, id_bytes,
                                                    "strict");
        if (message_id == NULL) {
            goto decode_failed;
        }
        PyList_SET_ITEM(columns[4], i, message_id);
        for (int c = 0; c < 3; c++) {
            PyObject *value = PyLong_FromUnsignedLongLong(get_be(data + 8 * c, 8));
            if (value == NULL) {
                goto done;
            }
            PyList_SET_ITEM(columns[c], i, value);
        }
    }
    result = PyTuple_Pack(5, columns[0], columns[1], columns[2], columns[3], columns[4]);
    goto done;
decode_failed:
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        goto done; /* out of memory: raised */
    }
    PyErr_Clear();
invalid:
    Py_INCREF(Py_None);
    result = Py_None;
done:
    /* A list's unset items are NULL, which its dealloc skips. */
    for (int c = 0; c < 5; c++) {
        Py_XDECREF(columns[c]);
    }
    return result;
}

#include "_run_codec.h"


static PyMethodDef methods[] = {
    {"encode_entries", encode_entries, METH_VARARGS,
     "encode_entries(timestamps_ms, message_log_offsets, sizes_bytes, tag_blooms) -> bytes"},
    {"encode_subject_records", encode_subject_records, METH_VARARGS,
     "encode_subject_records(timestamp_ms, subject_utf8, sequences, tag_blooms, ids_utf8, "
     "payloads) -> list[bytes]"},
    {"encode_visible_records", encode_visible_records, METH_VARARGS,
     "encode_visible_records(timestamp_ms, subject_utf8, sequences, tag_blooms, held_offsets, "
     "ids_utf8, payloads) -> list[bytes]"},
    {"check_run", check_run, METH_VARARGS,
     "check_run(message_ids, payloads, id_bytes_max) -> (ids_utf8, id_bytes_longest, "
     "payload_bytes_longest) | None"},
    {"encode_run", encode_run, METH_VARARGS,
     "encode_run(timestamp_ms, subject, first_sequence, message_ids, payloads, log_offset, "
     "room_bytes, id_bytes_max, record_bytes_max) -> (framed, entries) | None"},
    {"write_run", write_run, METH_VARARGS,
     "write_run(fd, file_offset, then_fd, then_offset, timestamp_ms, subject, "
     "first_sequence, message_ids, payloads, log_offset, room_bytes, id_bytes_max, "
     "record_bytes_max) -> (framed_bytes, written, write_errno, fsync_errno, fsync_ns, "
     "synced_at_ns, then_written, then_errno) | None"},
    {"encode_held_entries", encode_held_entries, METH_O,
     "encode_held_entries(held) -> bytes"},
    {"decode_message_headers", decode_message_headers, METH_O,
     "decode_message_headers(bodies) -> (timestamps_ms, sequences, tag_blooms, subjects, "
     "message_ids) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "realtime.storage._codecs",
    "C twins of the realtime store's batch encoders (optional speed-up).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__codecs(void)
{
    return PyModule_Create(&module_def);
}
