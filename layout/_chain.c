/* Optional C accelerator for the sha256 page-hash chain of hicache_store.layout.hashing.
 *
 * chain_sha256(tokens, page_size, prior, key=None) -> bytes
 *   tokens: a list of integers (Python ints or anything with __index__, e.g. numpy int64),
 *           each in [0, 2**63), or a bytes-like object holding uint32 little-endian ids;
 *           page_size > 0; prior: 32 raw bytes or None.
 *   Returns the raw 32-byte digests of every full page, concatenated:
 *   h_0 = sha256(prior || page_0) (no prior: sha256(page_0)), h_i = sha256(h_{i-1} || page_i).
 *   A page is its ids as uint32 little-endian; a page holding an id of 2**32 or more is
 *   0xff followed by its ids as uint64 little-endian (SGLang 0.5.23's wide encoding: the odd
 *   byte count keeps the two encodings apart).
 *   With key (a tenant's page key, bytes), each returned digest is HMAC-SHA256(key, h_i)
 *   instead of h_i (the keyed page hash of hicache_store.layout.sealing); the chain itself
 *   runs on the unkeyed h_i, so keyed and unkeyed chains are one loop.
 *
 * key_digests(key, digests, width) -> bytes
 *   digests: concatenated raw digests of ``width`` bytes (16 or 32); returns
 *   HMAC-SHA256(key, d)[:width] for each, concatenated (keying hashes an engine passes in).
 *
 * It computes exactly what the pure-Python loop computes (the tests compare both, and both
 * against SGLang's get_hash_str); it exists because the per-page Python overhead and the
 * list -> uint32 conversion dominate the cost of hashing a long prompt. OpenSSL's EVP
 * interface is used so SHA extensions are used when the CPU has them. If this module cannot
 * be built, hashing.py falls back to the Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 32

static EVP_MD *sha256_md = NULL;

#define WIDE_TAG 0xff
#define MAX_TOKEN 0x7FFFFFFFFFFFFFFFULL
static const char RANGE_MESSAGE[] = "tokens: ids must be integers in [0, 2**63)";

/* HMAC-SHA256 with the key's inner and outer pad states computed once (RFC 2104). */
typedef struct {
    EVP_MD_CTX *inner, *outer, *work;
} hmac_state;

static void hmac_free(hmac_state *h) {
    EVP_MD_CTX_free(h->inner);
    EVP_MD_CTX_free(h->outer);
    EVP_MD_CTX_free(h->work);
}

static int hmac_init(hmac_state *h, const unsigned char *key, size_t key_len) {
    unsigned char block[64] = {0}, pad[64];
    unsigned int n = 0;
    h->inner = EVP_MD_CTX_new();
    h->outer = EVP_MD_CTX_new();
    h->work = EVP_MD_CTX_new();
    if (h->inner == NULL || h->outer == NULL || h->work == NULL) return 0;
    if (key_len > sizeof block) { /* long keys are hashed first */
        if (EVP_Digest(key, key_len, block, &n, sha256_md, NULL) != 1) return 0;
    } else {
        memcpy(block, key, key_len);
    }
    for (int i = 0; i < 64; i++) pad[i] = block[i] ^ 0x36;
    if (EVP_DigestInit_ex(h->inner, sha256_md, NULL) != 1 ||
        EVP_DigestUpdate(h->inner, pad, 64) != 1)
        return 0;
    for (int i = 0; i < 64; i++) pad[i] = block[i] ^ 0x5c;
    return EVP_DigestInit_ex(h->outer, sha256_md, NULL) == 1 &&
           EVP_DigestUpdate(h->outer, pad, 64) == 1;
}

static int hmac_one(hmac_state *h, const unsigned char *msg, size_t len, unsigned char *out) {
    unsigned char inner[DIGEST];
    unsigned int n = 0;
    return EVP_MD_CTX_copy_ex(h->work, h->inner) == 1 &&
           EVP_DigestUpdate(h->work, msg, len) == 1 &&
           EVP_DigestFinal_ex(h->work, inner, &n) == 1 &&
           EVP_MD_CTX_copy_ex(h->work, h->outer) == 1 &&
           EVP_DigestUpdate(h->work, inner, DIGEST) == 1 &&
           EVP_DigestFinal_ex(h->work, out, &n) == 1 && n == DIGEST;
}

static int hash_page(EVP_MD_CTX *ctx, const unsigned char *prev, size_t prev_len, int wide,
                     const unsigned char *page, size_t page_len, unsigned char *out) {
    static const unsigned char tag = WIDE_TAG;
    unsigned int n = 0;
    return EVP_DigestInit_ex(ctx, sha256_md, NULL) == 1 &&
           (prev_len == 0 || EVP_DigestUpdate(ctx, prev, prev_len) == 1) &&
           (!wide || EVP_DigestUpdate(ctx, &tag, 1) == 1) &&
           EVP_DigestUpdate(ctx, page, page_len) == 1 &&
           EVP_DigestFinal_ex(ctx, out, &n) == 1 && n == DIGEST;
}

/* An exact int's value in [0, 2**63); -1 with ValueError set otherwise. Runs no Python code. */
static int int_value(PyObject *item, unsigned long long *value) {
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > MAX_TOKEN) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, RANGE_MESSAGE);
        return -1;
    }
    *value = v;
    return 0;
}

/* Any other item through __index__ (numpy integers); the caller holds a reference to it. */
static int index_value(PyObject *item, unsigned long long *value) {
    PyObject *index = PyNumber_Index(item);
    if (index == NULL) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, RANGE_MESSAGE);
        return -1;
    }
    int rc = int_value(index, value);
    Py_DECREF(index);
    return rc;
}

static inline void store_le(unsigned char *dst, unsigned long long v, int width) {
    for (int b = 0; b < width; b++) dst[b] = (unsigned char)((v >> (8 * b)) & 0xFF);
}

static PyObject *chain_sha256(PyObject *self, PyObject *args) {
    PyObject *tokens, *prior, *key = Py_None;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "OnO|O", &tokens, &page_size, &prior, &key)) return NULL;
    if (page_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_size: must be positive");
        return NULL;
    }
    char *key_bytes = NULL;
    Py_ssize_t key_len = 0;
    if (key != Py_None && PyBytes_AsStringAndSize(key, &key_bytes, &key_len) < 0) return NULL;
    hmac_state mac = {NULL, NULL, NULL};
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
    /* list mode: the page's ids (uint64), then its encoding (at most 8 bytes per id) */
    unsigned long long *ids = is_list ? PyMem_Malloc((size_t)page_size * sizeof(*ids)) : NULL;
    unsigned char *page_buf = is_list ? PyMem_Malloc((size_t)page_size * 8) : NULL;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (result == NULL || ctx == NULL || (is_list && (page_buf == NULL || ids == NULL))) {
        if (result != NULL) PyErr_NoMemory();
        goto fail;
    }
    if (key_bytes != NULL && !hmac_init(&mac, (const unsigned char *)key_bytes, (size_t)key_len)) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL HMAC setup failed");
        goto fail;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    unsigned char chain[2][DIGEST]; /* keyed: the unkeyed h_{i-1} and h_i, alternately */
    for (Py_ssize_t p = 0; p < pages; p++) {
        const unsigned char *page;
        size_t page_len = (size_t)page_size * 4;
        int wide = 0;
        if (is_list) {
            for (Py_ssize_t i = 0; i < page_size; i++) {
                PyObject *item = PyList_GET_ITEM(tokens, p * page_size + i);
                if (PyLong_CheckExact(item)) {
                    if (int_value(item, &ids[i]) < 0) goto fail;
                } else {
                    /* __index__ runs Python code, which may drop the item or shrink the
                     * list: hold a reference, and check the length afterwards. */
                    Py_INCREF(item);
                    int bad = index_value(item, &ids[i]);
                    Py_DECREF(item);
                    if (bad) goto fail;
                    if (PyList_GET_SIZE(tokens) < count) {
                        PyErr_SetString(PyExc_ValueError, "tokens: list changed while hashing");
                        goto fail;
                    }
                }
                wide |= ids[i] > 0xFFFFFFFFULL;
                store_le(page_buf + 4 * i, ids[i], 4); /* the narrow encoding, as we go */
            }
            if (wide) { /* rare: re-encode the page as uint64 */
                for (Py_ssize_t i = 0; i < page_size; i++) store_le(page_buf + 8 * i, ids[i], 8);
                page_len = (size_t)page_size * 8;
            }
            page = page_buf;
        } else {
            page = (const unsigned char *)view.buf + (size_t)p * page_size * 4;
        }
        const unsigned char *previous;
        if (p == 0)
            previous = prev;
        else
            previous = key_bytes != NULL ? chain[(p - 1) & 1] : out + (p - 1) * DIGEST;
        size_t previous_len = p == 0 ? prev_len : DIGEST;
        unsigned char *link = key_bytes != NULL ? chain[p & 1] : out + p * DIGEST;
        if (!hash_page(ctx, previous, previous_len, wide, page, page_len, link) ||
            (key_bytes != NULL && !hmac_one(&mac, link, DIGEST, out + p * DIGEST))) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL sha256 failed");
            goto fail;
        }
    }
    hmac_free(&mac);
    EVP_MD_CTX_free(ctx);
    PyMem_Free(page_buf);
    PyMem_Free(ids);
    if (!is_list) PyBuffer_Release(&view);
    return result;

fail:
    hmac_free(&mac);
    if (ctx != NULL) EVP_MD_CTX_free(ctx);
    PyMem_Free(page_buf);
    PyMem_Free(ids);
    if (!is_list) PyBuffer_Release(&view);
    Py_XDECREF(result);
    return NULL;
}

static PyObject *key_digests(PyObject *self, PyObject *args) {
    Py_buffer key, digests;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "y*y*n", &key, &digests, &width)) return NULL;
    PyObject *result = NULL;
    hmac_state mac = {NULL, NULL, NULL};
    if ((width != 16 && width != 32) || digests.len % width) {
        PyErr_SetString(PyExc_ValueError, "digests: a whole number of 16- or 32-byte digests");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, digests.len);
    if (result == NULL) goto done;
    if (!hmac_init(&mac, key.buf, (size_t)key.len)) goto openssl;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    unsigned char full[DIGEST];
    for (Py_ssize_t at = 0; at < digests.len; at += width) {
        if (!hmac_one(&mac, (const unsigned char *)digests.buf + at, (size_t)width, full))
            goto openssl;
        memcpy(out + at, full, (size_t)width);
    }
    goto done;
openssl:
    PyErr_SetString(PyExc_RuntimeError, "OpenSSL HMAC failed");
    Py_CLEAR(result);
done:
    hmac_free(&mac);
    PyBuffer_Release(&key);
    PyBuffer_Release(&digests);
    return result;
}

static PyMethodDef methods[] = {
    {"chain_sha256", chain_sha256, METH_VARARGS,
     "chain_sha256(tokens, page_size, prior, key=None) -> bytes: raw sha256 page-hash chain "
     "(keyed with HMAC-SHA256 when key is given)."},
    {"key_digests", key_digests, METH_VARARGS,
     "key_digests(key, digests, width) -> bytes: HMAC-SHA256(key, d)[:width] of each digest."},
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
