/* Optional C accelerator for the sha256 page-hash chain of hicache_store.layout.hashing.
 *
 * chain_sha256(tokens, page_size, prior) -> bytes
 *   tokens: a list of ints (each in uint32 range) or a bytes-like object holding uint32
 *           little-endian token ids; page_size > 0; prior: 32 raw bytes or None.
 *   Returns the raw 32-byte digests of every full page, concatenated:
 *   h_0 = sha256(prior || page_0) (no prior: sha256(page_0)), h_i = sha256(h_{i-1} || page_i).
 *
 * It computes exactly what the pure-Python loop computes (the tests compare both); it exists
 * because the per-page Python overhead and the list -> uint32 conversion dominate the cost of
 * hashing a long prompt. OpenSSL's EVP interface is used so SHA extensions are used when the CPU
 * has them. If this module cannot be built, hashing.py falls back to the Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 32

static EVP_MD *sha256_md = NULL;

static int hash_page(EVP_MD_CTX *ctx, const unsigned char *prev, size_t prev_len,
                     const unsigned char *page, size_t page_len, unsigned char *out) {
    unsigned int n = 0;
    return EVP_DigestInit_ex(ctx, sha256_md, NULL) == 1 &&
           (prev_len == 0 || EVP_DigestUpdate(ctx, prev, prev_len) == 1) &&
           EVP_DigestUpdate(ctx, page, page_len) == 1 &&
           EVP_DigestFinal_ex(ctx, out, &n) == 1 && n == DIGEST;
}

static PyObject *chain_sha256(PyObject *self, PyObject *args) {
    PyObject *tokens, *prior;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "OnO", &tokens, &page_size, &prior)) return NULL;
    if (page_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_size: must be positive");
        return NULL;
    }
    unsigned char prev[DIGEST];
    size_t prev_len = 0;
    if (prior != Py_None) {
        char *p;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(prior, &p, &len) < 0) return NULL;
        if (len != DIGEST) {
            PyErr_SetString(PyExc_ValueError, "prior_hash: expected 32 bytes for sha256");
            return NULL;
        }
        memcpy(prev, p, DIGEST);
        prev_len = DIGEST;
    }

    int is_list = PyList_Check(tokens);
    Py_buffer view = {0};
    Py_ssize_t count;
    if (is_list) {
        count = PyList_GET_SIZE(tokens);
    } else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0) return NULL;
        count = view.len / 4;
    }
    Py_ssize_t pages = count / page_size;
    PyObject *result = PyBytes_FromStringAndSize(NULL, pages * DIGEST);
    unsigned char *page_buf = is_list ? PyMem_Malloc((size_t)page_size * 4) : NULL;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (result == NULL || ctx == NULL || (is_list && page_buf == NULL)) {
        if (result != NULL || ctx == NULL || (is_list && page_buf == NULL)) PyErr_NoMemory();
        goto fail;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    for (Py_ssize_t p = 0; p < pages; p++) {
        const unsigned char *page;
        if (is_list) {
            for (Py_ssize_t i = 0; i < page_size; i++) {
                PyObject *item = PyList_GET_ITEM(tokens, p * page_size + i);
                unsigned long value = PyLong_AsUnsignedLong(item);
                if (value == (unsigned long)-1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    PyErr_SetString(PyExc_ValueError,
                                    "tokens: ids must be integers in uint32 range");
                    goto fail;
                }
                if (value > 0xFFFFFFFFUL) {
                    PyErr_SetString(PyExc_ValueError,
                                    "tokens: ids must be integers in uint32 range");
                    goto fail;
                }
                uint32_t v = (uint32_t)value;
                unsigned char *dst = page_buf + 4 * i;
                dst[0] = (unsigned char)(v & 0xFF);
                dst[1] = (unsigned char)((v >> 8) & 0xFF);
                dst[2] = (unsigned char)((v >> 16) & 0xFF);
                dst[3] = (unsigned char)((v >> 24) & 0xFF);
            }
            page = page_buf;
        } else {
            page = (const unsigned char *)view.buf + (size_t)p * page_size * 4;
        }
        const unsigned char *previous = p == 0 ? prev : out + (p - 1) * DIGEST;
        size_t previous_len = p == 0 ? prev_len : DIGEST;
        if (!hash_page(ctx, previous, previous_len, page, (size_t)page_size * 4,
                       out + p * DIGEST)) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL sha256 failed");
            goto fail;
        }
    }
    EVP_MD_CTX_free(ctx);
    PyMem_Free(page_buf);
    if (!is_list) PyBuffer_Release(&view);
    return result;

fail:
    if (ctx != NULL) EVP_MD_CTX_free(ctx);
    PyMem_Free(page_buf);
    if (!is_list) PyBuffer_Release(&view);
    Py_XDECREF(result);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_sha256", chain_sha256, METH_VARARGS,
     "chain_sha256(tokens, page_size, prior) -> bytes: raw sha256 page-hash chain."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) {
    sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (sha256_md == NULL) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL has no SHA256");
        return NULL;
    }
    return PyModule_Create(&module);
}
