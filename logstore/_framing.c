/* logstore._framing: the C twin of logstore.record.frame_records (optional speed-up).
 *
 * frame_records(bodies: list[bytes]) -> bytes frames every body as one logstore record, back to
 * back, exactly as record.encode_record does (the layout table is in logstore/record.py):
 *
 *     u32 body_length | u32 crc32 | u16 magic 0x514D | u8 version 1 | u8 attributes 0 | body
 *
 * all big-endian, the CRC being zlib's CRC-32 over bytes 0..3 and 8..end (this links zlib and calls
 * its crc32, like delayserver/_due_records.c and realtime/storage/_codecs.c). Why C: a log append is dominated by per-record Python
 * calls (length, CRC, header pack, join); here they cost one loop iteration. record.py falls
 * back to the pure-Python frame_records when this module was not built, and the codec tests
 * check both against zlib.crc32.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#define HEADER_SIZE_BYTES 12
/* Continue a CRC-32 with zlib's (the same function as Python's zlib.crc32):
 * crc32_update(crc32_update(0, a), b) == zlib.crc32(a + b). */
static uint32_t crc32_update(uint32_t crc, const unsigned char *data, size_t size)
{
    return (uint32_t)crc32_z(crc, data, size);
}

static void store_be32(unsigned char *p, uint32_t value)
{
    p[0] = (unsigned char)(value >> 24);
    p[1] = (unsigned char)(value >> 16);
    p[2] = (unsigned char)(value >> 8);
    p[3] = (unsigned char)value;
}

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
        store_be32(out, (uint32_t)size);
        out[8] = 0x51; /* magic 0x514D, "QM" */
        out[9] = 0x4D;
        out[10] = 1; /* version */
        out[11] = 0; /* attributes */
        memcpy(out + HEADER_SIZE_BYTES, PyBytes_AS_STRING(body), (size_t)size);
        uint32_t crc = crc32_update(0, out, 4);
        crc = crc32_update(crc, out + 8, 4 + (size_t)size);
        store_be32(out + 4, crc);
        out += HEADER_SIZE_BYTES + size;
    }
    return framed;
}

static PyMethodDef framing_methods[] = {
    {"frame_records", frame_records, METH_O,
     "frame_records(bodies: list[bytes]) -> bytes\n\n"
     "Frame every body as a logstore record, back to back (the same bytes as\n"
     "logstore.record.encode_record on each, joined)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef framing_module = {
    PyModuleDef_HEAD_INIT,
    "logstore._framing",
    "C twin of logstore.record.frame_records (see logstore/_framing.c).",
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
