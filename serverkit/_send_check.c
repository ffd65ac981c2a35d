/* serverkit._send_check: the C twin of serverkit.send_check.QuickCheck.check over a batch (optional).
 *
 * check_many(payloads, deliver_at_max_ms, valid_subjects, checked_type, body_bytes_max,
 *            id_chars_max, tags_max, tag_bytes_max) -> list
 *
 * One entry per payload: a ``checked_type`` tuple (serverkit.send_check.Checked) when the payload is
 * surely a valid message, else None, meaning "not decided here": the caller then runs the
 * Python QuickCheck.check on that payload, which runs the full check in turn. So this function
 * may only ever accept what the Python check accepts, with the same fields; it may defer more.
 *
 * It reads the msgpack map (wire.message's one-letter keys) straight from the bytes, building no
 * dict and no body object. It decides only the common shapes and defers everything else:
 *   - the keys i, s, b, c (required), d, x, r (optional ints) and t (optional tags), each at
 *     most once; any other key (properties "p" included) defers;
 *   - i: 1..id_chars_max bytes, each 0x21..0x7e (validate_message_id's rule);
 *   - s: ASCII, and already in ``valid_subjects`` (the Python check's cache of subjects it
 *     validated; a new subject defers once, and the Python check adds it);
 *   - b: msgpack bin of at most body_bytes_max bytes; c: an int >= 0;
 *   - d, x: ints >= 0 (nil defers), d at most deliver_at_max_ms; r: an int >= 0;
 *   - t: an array of at most tags_max str, each 1..tag_bytes_max bytes of valid UTF-8
 *     (validate_tags' rule; msgpack's own decoding refuses invalid UTF-8 too);
 *   - the map is the whole payload (trailing bytes defer).
 * Why C: on a broker this check ran once per message in Python, decoding a dict per payload;
 * here a batch costs one call. tests/unit/test_send_check.py holds the two to the same answers.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    const unsigned char *at;
    const unsigned char *end;
} Reader;

/* Big-endian unsigned of ``size`` bytes; 0 when the bytes are there, -1 when truncated. */
static int read_be(Reader *r, int size, uint64_t *out)
{
    if (r->end - r->at < size) {
        return -1;
    }
    uint64_t value = 0;
    for (int i = 0; i < size; i++) {
        value = value << 8 | r->at[i];
    }
    r->at += size;
    *out = value;
    return 0;
}

/* A msgpack int >= 0 into *out: 0; nil: 1; anything else (negative, other type, truncated): -1. */
static int read_uint(Reader *r, uint64_t *out)
{
    if (r->at >= r->end) {
        return -1;
    }
    unsigned char type = *r->at++;
    if (type <= 0x7f) {
        *out = type;
        return 0;
    }
    if (type == 0xc0) {
        return 1;
    }
    if (type >= 0xcc && type <= 0xcf) {
        return read_be(r, 1 << (type - 0xcc), out);
    }
    if (type >= 0xd0 && type <= 0xd3) {
        int size = 1 << (type - 0xd0);
        if (read_be(r, size, out) < 0 || (*out >> (size * 8 - 1)) & 1) {
            return -1; /* truncated, or the sign bit is set: negative */
        }
        return 0;
    }
    return -1;
}

/* A msgpack str: 0 with its bytes, -1 otherwise. */
static int read_str(Reader *r, const unsigned char **data, uint64_t *size)
{
    if (r->at >= r->end) {
        return -1;
    }
    unsigned char type = *r->at++;
    if (type >= 0xa0 && type <= 0xbf) {
        *size = type & 0x1f;
    } else if (type >= 0xd9 && type <= 0xdb) {
        if (read_be(r, 1 << (type - 0xd9), size) < 0) {
            return -1;
        }
    } else {
        return -1;
    }
    if ((uint64_t)(r->end - r->at) < *size) {
        return -1;
    }
    *data = r->at;
    r->at += *size;
    return 0;
}

/* A msgpack bin, skipped: 0 with its size, -1 otherwise. */
static int skip_bin(Reader *r, uint64_t *size)
{
    if (r->at >= r->end) {
        return -1;
    }
    unsigned char type = *r->at++;
    if (type < 0xc4 || type > 0xc6 || read_be(r, 1 << (type - 0xc4), size) < 0
            || (uint64_t)(r->end - r->at) < *size) {
        return -1;
    }
    r->at += *size;
    return 0;
}

enum {
    SEEN_I = 1, SEEN_S = 2, SEEN_B = 4, SEEN_C = 8, SEEN_D = 16, SEEN_X = 32, SEEN_R = 64,
    SEEN_T = 128,
};

typedef struct {
    long long deliver_at_max_ms;
    PyObject *valid_subjects;
    PyTypeObject *checked_type;
    uint64_t body_bytes_max;
    uint64_t id_chars_max;
    uint64_t tags_max;
    uint64_t tag_bytes_max;
} Limits;

/* The tags array as a tuple of str: a new reference; Py_None (new) to defer; NULL on a Python
 * error other than a tag that is not valid UTF-8 (which defers). */
static PyObject *read_tags(Reader *r, const Limits *limits)
{
    uint64_t count;
    if (r->at >= r->end) {
        Py_RETURN_NONE;
    }
    unsigned char type = *r->at++;
    if (type >= 0x90 && type <= 0x9f) {
        count = type & 0x0f;
    } else if (type == 0xdc || type == 0xdd) {
        if (read_be(r, type == 0xdc ? 2 : 4, &count) < 0) {
            Py_RETURN_NONE;
        }
    } else {
        Py_RETURN_NONE;
    }
    if (count > limits->tags_max) {
        Py_RETURN_NONE;
    }
    PyObject *tags = PyTuple_New((Py_ssize_t)count);
    if (tags == NULL) {
        return NULL;
    }
    for (uint64_t i = 0; i < count; i++) {
        const unsigned char *tag;
        uint64_t size;
        if (read_str(r, &tag, &size) < 0 || size < 1 || size > limits->tag_bytes_max) {
            Py_DECREF(tags);
            Py_RETURN_NONE;
        }
        PyObject *text = PyUnicode_DecodeUTF8((const char *)tag, (Py_ssize_t)size, "strict");
        if (text == NULL) {
            Py_DECREF(tags);
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                return NULL;
            }
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        PyTuple_SET_ITEM(tags, (Py_ssize_t)i, text);
    }
    return tags;
}

/* The Checked tuple of one payload; Py_None (a new reference) to defer; NULL on a Python error. */
static PyObject *check_one(const unsigned char *data, Py_ssize_t length, const Limits *limits)
{
    Reader r = {data, data + length};
    uint64_t count;
    if (r.at >= r.end) {
        Py_RETURN_NONE;
    }
    unsigned char type = *r.at++;
    if (type >= 0x80 && type <= 0x8f) {
        count = type & 0x0f;
    } else if (type == 0xde || type == 0xdf) {
        if (read_be(&r, type == 0xde ? 2 : 4, &count) < 0) {
            Py_RETURN_NONE;
        }
    } else {
        Py_RETURN_NONE;
    }
    if (count > 8) {
        Py_RETURN_NONE; /* more keys than i s b c d x r t: a repeated or unknown one */
    }
    PyObject *tags = NULL; /* owned; NULL until a t key is read */
    const unsigned char *id = NULL, *subject = NULL;
    uint64_t id_size = 0, subject_size = 0, body_size, created = 0, deliver = 0, expire = 0;
    uint64_t retries = 0;
    unsigned seen = 0;
    for (uint64_t i = 0; i < count; i++) {
        const unsigned char *key;
        uint64_t key_size;
        if (read_str(&r, &key, &key_size) < 0 || key_size != 1) {
            goto defer;
        }
        unsigned bit;
        int ok;
        switch (key[0]) {
        case 'i':
            bit = SEEN_I;
            ok = read_str(&r, &id, &id_size) == 0;
            break;
        case 's':
            bit = SEEN_S;
            ok = read_str(&r, &subject, &subject_size) == 0;
            break;
        case 'b':
            bit = SEEN_B;
            ok = skip_bin(&r, &body_size) == 0 && body_size <= limits->body_bytes_max;
            break;
        case 'c':
            bit = SEEN_C;
            ok = read_uint(&r, &created) == 0;
            break;
        case 'd':
            bit = SEEN_D;
            ok = read_uint(&r, &deliver) == 0 && limits->deliver_at_max_ms >= 0
                && deliver <= (uint64_t)limits->deliver_at_max_ms;
            break;
        case 'x':
            bit = SEEN_X;
            ok = read_uint(&r, &expire) == 0;
            break;
        case 'r':
            bit = SEEN_R;
            ok = read_uint(&r, &retries) == 0;
            break;
        case 't':
            bit = SEEN_T;
            ok = !(seen & SEEN_T);
            if (ok) {
                tags = read_tags(&r, limits);
                if (tags == NULL) {
                    return NULL;
                }
                ok = tags != Py_None;
            }
            break;
        default:
            ok = 0;
            bit = 0;
        }
        if (!ok || (seen & bit)) {
            goto defer;
        }
        seen |= bit;
    }
    unsigned required = SEEN_I | SEEN_S | SEEN_B | SEEN_C;
    if ((seen & required) != required || r.at != r.end) {
        goto defer;
    }
    if (id_size < 1 || id_size > limits->id_chars_max) {
        goto defer;
    }
    for (uint64_t i = 0; i < id_size; i++) {
        if (id[i] < 0x21 || id[i] > 0x7e) {
            goto defer;
        }
    }
    for (uint64_t i = 0; i < subject_size; i++) {
        if (subject[i] > 0x7f) {
            goto defer;
        }
    }
    PyObject *subject_str = PyUnicode_DecodeASCII((const char *)subject, subject_size, NULL);
    if (subject_str == NULL) {
        Py_XDECREF(tags);
        return NULL;
    }
    int known = PySet_Contains(limits->valid_subjects, subject_str);
    if (known != 1) {
        Py_DECREF(subject_str);
        if (known < 0) {
            Py_XDECREF(tags);
            return NULL;
        }
        goto defer;
    }
    PyObject *items[8];
    items[0] = PyUnicode_DecodeASCII((const char *)id, id_size, NULL);
    items[1] = subject_str;
    items[2] = tags != NULL ? tags : PyTuple_New(0); /* the reference moves to the tuple */
    items[3] = seen & SEEN_X ? PyLong_FromUnsignedLongLong(expire) : Py_NewRef(Py_None);
    items[4] = seen & SEEN_D ? PyLong_FromUnsignedLongLong(deliver) : Py_NewRef(Py_None);
    items[5] = PyLong_FromUnsignedLongLong(created);
    items[6] = PyLong_FromUnsignedLongLong(retries);
    items[7] = Py_NewRef(Py_None);
    PyObject *checked = NULL;
    int failed = 0;
    for (int i = 0; i < 8; i++) {
        failed |= items[i] == NULL;
    }
    if (!failed) {
        checked = limits->checked_type->tp_alloc(limits->checked_type, 8);
    }
    if (checked == NULL) {
        for (int i = 0; i < 8; i++) {
            Py_XDECREF(items[i]);
        }
        return NULL;
    }
    for (int i = 0; i < 8; i++) {
        PyTuple_SET_ITEM(checked, i, items[i]);
    }
    return checked;

defer:
    Py_XDECREF(tags); /* a tuple, or None from read_tags' own deferral */
    Py_RETURN_NONE;
}

static PyObject *check_many(PyObject *module, PyObject *args)
{
    PyObject *payloads;
    PyObject *checked_type;
    unsigned long long body_bytes_max, id_chars_max, tags_max, tag_bytes_max;
    Limits limits;
    if (!PyArg_ParseTuple(args, "O!LO!O!KKKK:check_many", &PyList_Type, &payloads,
                          &limits.deliver_at_max_ms, &PySet_Type, &limits.valid_subjects,
                          &PyType_Type, &checked_type, &body_bytes_max, &id_chars_max,
                          &tags_max, &tag_bytes_max)) {
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)checked_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "checked_type must be a tuple subclass");
        return NULL;
    }
    limits.checked_type = (PyTypeObject *)checked_type;
    limits.body_bytes_max = body_bytes_max;
    limits.id_chars_max = id_chars_max;
    limits.tags_max = tags_max;
    limits.tag_bytes_max = tag_bytes_max;
    Py_ssize_t count = PyList_GET_SIZE(payloads);
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        /* check_one allocates tuples, which can run the garbage collector and so any
         * finalizer, which could shrink the list and free a payload being read: hold the
         * payload, and look at the list's size again each time. */
        if (i >= PyList_GET_SIZE(payloads)) {
            PyErr_SetString(PyExc_RuntimeError, "payloads changed size during check_many");
            Py_DECREF(out);
            return NULL;
        }
        PyObject *payload = Py_NewRef(PyList_GET_ITEM(payloads, i));
        PyObject *checked;
        if (PyBytes_CheckExact(payload)) {
            checked = check_one((const unsigned char *)PyBytes_AS_STRING(payload),
                                PyBytes_GET_SIZE(payload), &limits);
        } else {
            checked = Py_NewRef(Py_None);
        }
        Py_DECREF(payload);
        if (checked == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, checked);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"check_many", check_many, METH_VARARGS,
     "check_many(payloads, deliver_at_max_ms, valid_subjects, checked_type, body_bytes_max, "
     "id_chars_max, tags_max, tag_bytes_max) -> list of checked_type tuples or None (not "
     "decided here)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "serverkit._send_check",
    "C twin of serverkit.send_check.QuickCheck.check over a batch (optional speed-up).", -1, methods,
};

PyMODINIT_FUNC PyInit__send_check(void)
{
    return PyModule_Create(&module);
}
