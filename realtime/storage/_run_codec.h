/* realtime/storage/_run_codec.h: the part of realtime.storage._codecs (realtime/storage/_codecs.c,
 * its only includer, after its helpers crc32_of, put_be, name_utf8 and logstore/_framing.h) that
 * checks and encodes the broker's usual commit, and writes it in one call:
 *
 * check_run(message_ids, payloads, id_bytes_max) -> (ids_utf8, id_bytes_longest,
 *                                                    payload_bytes_longest) | None
 *     write_batch.check_run: one subject's run of ids (str) and payloads (bytes), checked and
 *     the ids encoded to UTF-8 in one call; None (no error) when anything needs the slow path
 *     that names it: an id not a str, not UTF-8-encodable or outside [1, id_bytes_max] bytes,
 *     a payload not exactly bytes, an empty run or columns of different lengths.
 *
 * encode_run(timestamp_ms, subject, first_sequence, message_ids, payloads, log_offset,
 *            room_bytes, id_bytes_max, record_bytes_max) -> (framed, entries) | None
 *     commit_run.encode_run: the broker's usual commit (one subject, every message new, no
 *     tags) in one call: the run checked as check_run checks it (plus WriteBatch's bound: a
 *     record of the longest id and the longest payload within record_bytes_max), every
 *     message record framed as a logstore record straight into ONE buffer (no bytes object
 *     per record, no second copy: the frame is logstore/_framing.h's), numbered from
 *     first_sequence, and the consumer-log entries of the records (offsets from log_offset,
 *     tag bloom 0). None (no error) when the slow path
 *     is needed: what check_run refuses, that bound exceeded, a timestamp_ms not an int in
 *     [0, 2**64), or framed bytes over room_bytes.
 *
 * write_run(fd, file_offset, then_fd, then_offset, timestamp_ms, subject, first_sequence,
 *           message_ids, payloads, log_offset, room_bytes, id_bytes_max, record_bytes_max)
 *     -> (framed_bytes, written, write_errno, fsync_errno, fsync_ns, synced_at_ns,
 *         then_written, then_errno) | None
 *     commit_run.write_run: encode_run (None, nothing written, where it answers None), then
 *     the framed records written at file_offset of fd, fsynced, and the entries written at
 *     then_offset of then_fd, all with the GIL released once: logstore/_framing.h's durable
 *     write, which logstore._framing.write_sync makes too, reported as write_sync reports it
 *     (an OS error is an errno, never raised), after the framed records' size.
 *
 * A header of static functions, not a second translation unit, so the extension stays one
 * source file in setup.py and these share _codecs.c's static helpers; it keeps _codecs.c a
 * readable size.
 */

#ifndef QMQ_REALTIME_RUN_CODEC_H
#define QMQ_REALTIME_RUN_CODEC_H

/* write_batch.check_run's C twin (see the top of this file). Why C: the Python twin is five
 * C-level maps and reductions over the run, each a call with its own setup; a commit of a
 * few messages pays that setup, not the per-item work. */
static PyObject *check_run(PyObject *module, PyObject *args)
{
    PyObject *ids, *payloads;
    Py_ssize_t id_bytes_max;
    if (!PyArg_ParseTuple(args, "O!O!n:check_run", &PyList_Type, &ids, &PyList_Type, &payloads,
                          &id_bytes_max)) {
        return NULL;
    }
    (void)module;
    Py_ssize_t count = PyList_GET_SIZE(ids);
    if (count == 0 || PyList_GET_SIZE(payloads) != count) {
        Py_RETURN_NONE;
    }
    Py_ssize_t id_longest = 0, payload_longest = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *payload = PyList_GET_ITEM(payloads, i);
        if (!PyBytes_CheckExact(payload)) {
            Py_RETURN_NONE;
        }
        if (PyBytes_GET_SIZE(payload) > payload_longest) {
            payload_longest = PyBytes_GET_SIZE(payload);
        }
    }
    PyObject *encoded = PyList_New(count);
    if (encoded == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        /* PyUnicode_AsUTF8String runs no Python code, so the borrowed item stays valid. */
        PyObject *id = PyList_GET_ITEM(ids, i);
        if (!PyUnicode_Check(id)) {
            Py_DECREF(encoded);
            Py_RETURN_NONE;
        }
        PyObject *utf8 = PyUnicode_AsUTF8String(id);
        if (utf8 == NULL) {
            Py_DECREF(encoded);
            if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
                PyErr_Clear();
                Py_RETURN_NONE;
            }
            return NULL;
        }
        PyList_SET_ITEM(encoded, i, utf8);
        Py_ssize_t size = PyBytes_GET_SIZE(utf8);
        if (size < 1 || size > id_bytes_max) {
            Py_DECREF(encoded);
            Py_RETURN_NONE;
        }
        if (size > id_longest) {
            id_longest = size;
        }
    }
    return Py_BuildValue("Nnn", encoded, id_longest, payload_longest);
}

/* One message of an encode_run: its id's UTF-8 (borrowed from the str, which caches it), and
 * its payload (borrowed from the list). */
struct run_item {
    const char *id;
    Py_ssize_t id_size;
    PyObject *payload;
};

/* commit_run.encode_run's C twin (see the top of this file), its arguments parsed: (framed,
 * entries), None, or NULL with an error set. Two passes over the run: the
 * first checks it and sums the sizes, the second writes; no Python code runs in between (a
 * str's UTF-8 is made by CPython itself), so the borrowed items stay valid. Why C: the usual
 * commit made a bytes object per record, copied them all again to frame them, and called four
 * encoders; here it is one call and one copy of each payload. */
static PyObject *run_encoded(PyObject *timestamp_object, PyObject *subject,
                             long long first_sequence, PyObject *ids, PyObject *payloads,
                             long long log_offset, long long room_bytes,
                             Py_ssize_t id_bytes_max, Py_ssize_t record_bytes_max)
{
    if (!PyList_CheckExact(ids) || !PyList_CheckExact(payloads) || first_sequence < 0
            || log_offset < 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t count = PyList_GET_SIZE(ids);
    if (count == 0 || PyList_GET_SIZE(payloads) != count) {
        Py_RETURN_NONE;
    }
    uint64_t timestamp;
    if (!PyLong_CheckExact(timestamp_object)) {
        Py_RETURN_NONE;
    }
    timestamp = PyLong_AsUnsignedLongLong(timestamp_object);
    if (timestamp == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* negative or over 64 bits: the slow path names it */
        Py_RETURN_NONE;
    }
    Py_ssize_t subject_size;
    const char *subject_utf8 = PyUnicode_AsUTF8AndSize(subject, &subject_size);
    if (subject_utf8 == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (subject_size > 0xFFFF) {
        Py_RETURN_NONE;
    }
    struct run_item *items = PyMem_Malloc(sizeof(struct run_item) * (size_t)count);
    if (items == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    long long total = 0;
    Py_ssize_t id_longest = 0, payload_longest = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        PyObject *payload = PyList_GET_ITEM(payloads, i);
        if (!PyUnicode_Check(id) || !PyBytes_CheckExact(payload)) {
            goto slow_path;
        }
        items[i].id = PyUnicode_AsUTF8AndSize(id, &items[i].id_size);
        if (items[i].id == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
                goto done; /* MemoryError: raised */
            }
            PyErr_Clear();
            goto slow_path;
        }
        items[i].payload = payload;
        if (items[i].id_size < 1 || items[i].id_size > id_bytes_max) {
            goto slow_path;
        }
        if (items[i].id_size > id_longest) {
            id_longest = items[i].id_size;
        }
        if (PyBytes_GET_SIZE(payload) > payload_longest) {
            payload_longest = PyBytes_GET_SIZE(payload);
        }
        total += LOGSTORE_HEADER_SIZE_BYTES + RECORD_FIXED_BYTES + subject_size + 2
            + items[i].id_size + PyBytes_GET_SIZE(payload);
    }
    /* WriteBatch's bound: a record of the longest id and the longest payload (the general
     * path then checks each message alone); a frame's length is a u32. */
    Py_ssize_t longest = RECORD_FIXED_BYTES + subject_size + 2 + id_longest + payload_longest;
    if (longest > record_bytes_max || (uint64_t)longest > UINT32_MAX || total > room_bytes) {
        goto slow_path;
    }
    PyObject *framed = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    PyObject *entries = framed == NULL ? NULL
        : PyBytes_FromStringAndSize(NULL, count * ENTRY_BYTES);
    if (entries == NULL) {
        Py_XDECREF(framed);
        goto done;
    }
    unsigned char *record = (unsigned char *)PyBytes_AS_STRING(framed);
    unsigned char *entry = (unsigned char *)PyBytes_AS_STRING(entries);
    uint64_t offset = (uint64_t)log_offset;
    for (Py_ssize_t i = 0; i < count; i++, entry += ENTRY_BYTES) {
        Py_ssize_t id_size = items[i].id_size;
        Py_ssize_t payload_size = PyBytes_GET_SIZE(items[i].payload);
        size_t body = RECORD_FIXED_BYTES + (size_t)subject_size + 2 + (size_t)id_size
            + (size_t)payload_size;
        unsigned char *at = record + LOGSTORE_HEADER_SIZE_BYTES;
        put_be(at, timestamp, 8);
        put_be(at + 8, (uint64_t)first_sequence + (uint64_t)i, 8);
        put_be(at + 16, 0, 8); /* tag bloom: no tags */
        put_be(at + 24, (uint64_t)subject_size, 2);
        at += RECORD_FIXED_BYTES;
        memcpy(at, subject_utf8, (size_t)subject_size);
        at += subject_size;
        put_be(at, (uint64_t)id_size, 2);
        memcpy(at + 2, items[i].id, (size_t)id_size);
        memcpy(at + 2 + id_size, PyBytes_AS_STRING(items[i].payload), (size_t)payload_size);
        logstore_frame_in_place(record, body);
        put_be(entry, timestamp, 8);
        put_be(entry + 8, offset, 8);
        put_be(entry + 16, (uint64_t)body, 4);
        put_be(entry + 20, 0, 8);
        put_be(entry + ENTRY_HEAD_BYTES, crc32_of(entry, ENTRY_HEAD_BYTES), 4);
        offset += LOGSTORE_HEADER_SIZE_BYTES + body;
        record += LOGSTORE_HEADER_SIZE_BYTES + body;
    }
    result = PyTuple_Pack(2, framed, entries);
    Py_DECREF(framed);
    Py_DECREF(entries);
    goto done;
slow_path:
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(items);
    return result;
}

static PyObject *encode_run(PyObject *module, PyObject *args)
{
    PyObject *timestamp_object, *subject, *ids, *payloads;
    long long first_sequence, log_offset, room_bytes;
    Py_ssize_t id_bytes_max, record_bytes_max;
    if (!PyArg_ParseTuple(args, "OULOOLLnn:encode_run", &timestamp_object, &subject,
                          &first_sequence, &ids, &payloads, &log_offset, &room_bytes,
                          &id_bytes_max, &record_bytes_max)) {
        return NULL;
    }
    (void)module;
    return run_encoded(timestamp_object, subject, first_sequence, ids, payloads, log_offset,
                       room_bytes, id_bytes_max, record_bytes_max);
}

/* commit_run.write_run's C twin (see the top of this file): encode_run, then its framed
 * records and entries written as _framing.c's write_sync writes them (_framing.h), with no
 * bytes object handed back and forth in between. Why: the usual commit's Python between the
 * encoder and the write (SegmentedLog.append_framed_durably, sync_then, OsFile.append_and_sync
 * and their argument handling) was a third of its Python calls. */
static PyObject *write_run(PyObject *module, PyObject *args)
{
    int fd, then_fd;
    long long file_offset, then_offset;
    PyObject *timestamp_object, *subject, *ids, *payloads;
    long long first_sequence, log_offset, room_bytes;
    Py_ssize_t id_bytes_max, record_bytes_max;
    if (!PyArg_ParseTuple(args, "iLiLOULOOLLnn:write_run", &fd, &file_offset, &then_fd,
                          &then_offset, &timestamp_object, &subject, &first_sequence, &ids,
                          &payloads, &log_offset, &room_bytes, &id_bytes_max,
                          &record_bytes_max)) {
        return NULL;
    }
    (void)module;
    if (file_offset < 0 || then_offset < 0) {
        PyErr_Format(PyExc_ValueError, "offsets %lld, %lld: one is negative", file_offset,
                     then_offset);
        return NULL;
    }
    PyObject *encoded = run_encoded(timestamp_object, subject, first_sequence, ids, payloads,
                                    log_offset, room_bytes, id_bytes_max, record_bytes_max);
    if (encoded == NULL || encoded == Py_None) {
        return encoded;
    }
    PyObject *framed = PyTuple_GET_ITEM(encoded, 0);
    PyObject *entries = PyTuple_GET_ITEM(encoded, 1);
    struct logstore_sync_write w = {
        .fd = fd, .data = PyBytes_AS_STRING(framed), .size = PyBytes_GET_SIZE(framed),
        .offset = file_offset, .then_fd = then_fd, .then_data = PyBytes_AS_STRING(entries),
        .then_size = PyBytes_GET_SIZE(entries), .then_offset = then_offset,
    };
    /* The tuple keeps both buffers alive; nothing here touches a Python object while the
     * GIL is released. */
    Py_BEGIN_ALLOW_THREADS
    logstore_write_sync_released(&w);
    Py_END_ALLOW_THREADS
    Py_DECREF(encoded);
    return Py_BuildValue("(nniiLLni)", w.size, w.written, w.write_errno, w.fsync_errno,
                         w.fsync_ns, w.synced_at_ns, w.then_written, w.then_errno);
}

#endif /* QMQ_REALTIME_RUN_CODEC_H */
