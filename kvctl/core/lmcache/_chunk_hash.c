/* The prefix-chained chunk hashes of LMCache's in-process keys, one C loop per prompt.

   LMCache hashes each chunk as hash_function((prefix, tuple(chunk_tokens), ())). For the CBOR
   hashes (sha256_cbor, xxhash_cbor) that is canonical CBOR of the tuple, which cbor2 encodes one
   Python object at a time: most of a 128K-token prompt's time. Here the CBOR of the tuple is written
   straight from the token list (the shortest form of each integer, as canonical CBOR requires) and
   handed to the digest. For builtin, the tuple is built and hashed without the interpreter's loop.

   Anything outside what LMCache can hash here (an integer of 64 bits or more, a token that is not
   an int) raises TypeError or OverflowError: the caller then takes the cbor2 path, which knows bignums. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Appends the CBOR head of major type `major` with argument `value` (shortest form); returns the end. */
static unsigned char *put_head(unsigned char *out, unsigned char major, uint64_t value) {
    major <<= 5;
    if (value < 24) {
        *out++ = major | (unsigned char)value;
    } else if (value <= 0xff) {
        *out++ = major | 24;
        *out++ = (unsigned char)value;
    } else if (value <= 0xffff) {
        *out++ = major | 25;
        *out++ = (unsigned char)(value >> 8);
        *out++ = (unsigned char)value;
    } else if (value <= 0xffffffffULL) {
        *out++ = major | 26;
        for (int shift = 24; shift >= 0; shift -= 8) *out++ = (unsigned char)(value >> shift);
    } else {
        *out++ = major | 27;
        for (int shift = 56; shift >= 0; shift -= 8) *out++ = (unsigned char)(value >> shift);
    }
    return out;
}

/* Appends the CBOR of a Python int (major type 0 or 1); NULL with an exception set when it cannot. */
static unsigned char *put_int(unsigned char *out, PyObject *number) {
    if (!PyLong_CheckExact(number)) {  /* a bool is an int that CBOR writes as true or false */
        PyErr_SetString(PyExc_TypeError, "a token is not an int");
        return NULL;
    }
    int overflow = 0;
    long long small = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (overflow == 0) {
        if (small == -1 && PyErr_Occurred()) return NULL;
        return small >= 0 ? put_head(out, 0, (uint64_t)small) : put_head(out, 1, (uint64_t)(-1 - small));
    }
    if (overflow > 0) {  /* 2**63 .. 2**64 - 1 still fit major type 0 */
        unsigned long long big = PyLong_AsUnsignedLongLong(number);
        if (big == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        return put_head(out, 0, big);
    }
    PyErr_SetString(PyExc_OverflowError, "an integer below -2**63");
    return NULL;
}

/* The tokens' items, fetched again for every chunk: a digest or a token's __hash__ runs Python code,
   which may have resized the list. NULL with an exception set when it no longer reaches `stop`. */
static PyObject **chunk_items(PyObject *tokens, Py_ssize_t stop) {
    if (PySequence_Fast_GET_SIZE(tokens) < stop) {
        PyErr_SetString(PyExc_ValueError, "the tokens changed while they were hashed");
        return NULL;
    }
    return PySequence_Fast_ITEMS(tokens);
}

static int chunk_arguments(PyObject *tokens, Py_ssize_t size, Py_ssize_t stop) {
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list or a tuple");
        return -1;
    }
    if (size <= 0 || stop < 0 || stop > PySequence_Fast_GET_SIZE(tokens)) {
        PyErr_SetString(PyExc_ValueError, "size must be positive and stop within the tokens");
        return -1;
    }
    return 0;
}

/* cbor_chain(prefix, tokens, size, stop, digest) -> list of int: for each chunk tokens[start:start+size]
   (start in range(0, stop, size), the last one cut at stop), prefix = int.from_bytes(digest(cbor((prefix,
   tuple(chunk), ())))[:8], "big"); the list of those prefixes. */
static PyObject *cbor_chain(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *prefix, *tokens, *digest;
    Py_ssize_t size, stop;
    if (!PyArg_ParseTuple(args, "OOnnO", &prefix, &tokens, &size, &stop, &digest)) return NULL;
    if (chunk_arguments(tokens, size, stop) < 0) return NULL;
    /* 0x83, the prefix (9), the chunk's array head (5), 9 per token, 0x80 */
    unsigned char *buffer = PyMem_Malloc(1 + 9 + 5 + 9 * (size_t)size + 1);
    PyObject *hashes = PyList_New(0);
    if (buffer == NULL || hashes == NULL) {
        PyMem_Free(buffer);
        Py_XDECREF(hashes);
        return PyErr_NoMemory();
    }
    Py_INCREF(prefix);
    for (Py_ssize_t start = 0; start < stop; start += size) {
        Py_ssize_t end = start + size < stop ? start + size : stop;
        PyObject **items = chunk_items(tokens, stop);
        if (items == NULL) goto fail;
        unsigned char *out = buffer;
        *out++ = 0x83;
        out = put_int(out, prefix);
        if (out == NULL) goto fail;
        out = put_head(out, 4, (uint64_t)(end - start));
        for (Py_ssize_t index = start; index < end; index++) {
            out = put_int(out, items[index]);
            if (out == NULL) goto fail;
        }
        *out++ = 0x80;
        PyObject *encoded = PyBytes_FromStringAndSize((const char *)buffer, out - buffer);
        if (encoded == NULL) goto fail;
        PyObject *hashed = PyObject_CallOneArg(digest, encoded);
        Py_DECREF(encoded);
        if (hashed == NULL) goto fail;
        if (!PyBytes_Check(hashed) || PyBytes_GET_SIZE(hashed) < 8) {
            Py_DECREF(hashed);
            PyErr_SetString(PyExc_TypeError, "digest must return at least 8 bytes");
            goto fail;
        }
        const unsigned char *head = (const unsigned char *)PyBytes_AS_STRING(hashed);
        uint64_t value = 0;
        for (int byte = 0; byte < 8; byte++) value = (value << 8) | head[byte];
        Py_DECREF(hashed);
        Py_DECREF(prefix);
        prefix = PyLong_FromUnsignedLongLong(value);
        if (prefix == NULL || PyList_Append(hashes, prefix) < 0) goto fail;
    }
    Py_DECREF(prefix);
    PyMem_Free(buffer);
    return hashes;
fail:
    Py_XDECREF(prefix);
    PyMem_Free(buffer);
    Py_DECREF(hashes);
    return NULL;
}

/* builtin_chain(prefix, tokens, size, stop) -> list of int: prefix = hash((prefix, tuple(chunk), ())) per
   chunk, Python's own tuple hash (so the process's PYTHONHASHSEED applies as it does in LMCache). */
static PyObject *builtin_chain(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *prefix, *tokens;
    Py_ssize_t size, stop;
    if (!PyArg_ParseTuple(args, "OOnn", &prefix, &tokens, &size, &stop)) return NULL;
    if (chunk_arguments(tokens, size, stop) < 0) return NULL;
    PyObject *empty = PyTuple_New(0);
    PyObject *hashes = PyList_New(0);
    if (empty == NULL || hashes == NULL) goto fail_early;
    Py_INCREF(prefix);
    for (Py_ssize_t start = 0; start < stop; start += size) {
        Py_ssize_t end = start + size < stop ? start + size : stop;
        PyObject **items = chunk_items(tokens, stop);
        if (items == NULL) goto fail;
        PyObject *chunk = PyTuple_New(end - start);
        if (chunk == NULL) goto fail;
        for (Py_ssize_t index = start; index < end; index++) {
            Py_INCREF(items[index]);
            PyTuple_SET_ITEM(chunk, index - start, items[index]);
        }
        PyObject *triple = PyTuple_Pack(3, prefix, chunk, empty);
        Py_DECREF(chunk);
        if (triple == NULL) goto fail;
        Py_hash_t value = PyObject_Hash(triple);
        Py_DECREF(triple);
        if (value == -1 && PyErr_Occurred()) goto fail;
        Py_DECREF(prefix);
        prefix = PyLong_FromSsize_t(value);
        if (prefix == NULL || PyList_Append(hashes, prefix) < 0) goto fail;
    }
    Py_DECREF(prefix);
    Py_DECREF(empty);
    return hashes;
fail:
    Py_XDECREF(prefix);
fail_early:
    Py_XDECREF(empty);
    Py_XDECREF(hashes);
    return NULL;
}

static PyMethodDef methods[] = {
    {"cbor_chain", cbor_chain, METH_VARARGS, "Chained digests of the canonical CBOR of each chunk's tuple."},
    {"builtin_chain", builtin_chain, METH_VARARGS, "Chained hash() of each chunk's tuple."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chunk_hash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chunk_hash(void) { return PyModule_Create(&module); }
