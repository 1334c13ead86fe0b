/* Optional C accelerator for batches of storage keys (hicache_store.layout.keys).
 *
 * storage_keys_valid(keys) -> bool
 *   keys: a list. True when every item is an exact str of 1-255 characters inside the
 *   storage-key grammar (layout/keys.py: [0-9a-fA-Zkuv][0-9a-fA-Zkuv_-]*); False otherwise,
 *   and then the caller runs the per-key Python check, which raises for the first bad key.
 *   One pass over each key's characters (compact ASCII strings are read in place); no
 *   joined copy, no Python object per key.
 *
 * xxh3_64_each(keys) -> bytes | None
 *   keys: a list of str. The XXH3-64 (seed 0, default secret) of each key's UTF-8 bytes, as
 *   native-endian uint64 values, concatenated: exactly xxhash.xxh3_64_intdigest(key.encode())
 *   per key (the tests compare both for every length). None when some item is not an exact
 *   str or its UTF-8 is longer than 240 bytes (XXH3's long-input path is not implemented
 *   here: a valid storage key is at most 255 bytes, and the caller hashes such a batch in
 *   Python).
 *
 * Both exist because ``exists`` on the file backend answers from 64-bit key fingerprints, and
 * for a batch of keys the per-key Python work around them (a regex-free check, ``encode``, one
 * hash call and one int per key) cost more than the lookup itself. XXH3 is written here from
 * its specification (doc/xxhash_spec.md of the xxHash project): only the inputs up to 240
 * bytes, seed 0, the default secret.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_KEY_LENGTH 255
#define MAX_HASHED 240

/* ---- the storage-key grammar ---------------------------------------------------------------- */

/* 1 for the bytes that may appear in a storage key ([0-9a-fA-Zkuv_-]), else 0. */
static unsigned char key_byte[256];

static void init_key_bytes(void) {
    const char *allowed = "0123456789abcdefkuvABCDEFGHIJKLMNOPQRSTUVWXYZ_-";
    for (const char *c = allowed; *c; c++) key_byte[(unsigned char)*c] = 1;
}

#if defined(__SSE2__)
#include <emmintrin.h>

/* 0xff in each byte lane of c (signed bytes, ASCII) that lies in [lo, hi]. */
static inline __m128i in_range(__m128i c, char lo, char hi) {
    return _mm_and_si128(_mm_cmpgt_epi8(c, _mm_set1_epi8((char)(lo - 1))),
                         _mm_cmplt_epi8(c, _mm_set1_epi8((char)(hi + 1))));
}

/* Whether all 16 bytes at p are key bytes. */
static inline int key_block(const unsigned char *p) {
    __m128i c = _mm_loadu_si128((const __m128i *)p);
    __m128i ok = _mm_or_si128(
        _mm_or_si128(in_range(c, '0', '9'), in_range(c, 'a', 'f')),
        _mm_or_si128(in_range(c, 'A', 'Z'), _mm_cmpeq_epi8(c, _mm_set1_epi8('_'))));
    ok = _mm_or_si128(ok, _mm_or_si128(_mm_cmpeq_epi8(c, _mm_set1_epi8('-')),
                                       _mm_cmpeq_epi8(c, _mm_set1_epi8('k'))));
    ok = _mm_or_si128(ok, _mm_or_si128(_mm_cmpeq_epi8(c, _mm_set1_epi8('u')),
                                       _mm_cmpeq_epi8(c, _mm_set1_epi8('v'))));
    return _mm_movemask_epi8(ok) == 0xFFFF;
}
#endif

/* Whether s[0:len] is all key bytes: 16 bytes a step where SSE2 is there (a key of 16 bytes or
 * more is covered by whole blocks, the last one overlapping), else a table lookup a byte. */
static int all_key_bytes(const unsigned char *s, Py_ssize_t len) {
#if defined(__SSE2__)
    if (len >= 16) {
        for (Py_ssize_t j = 0; j + 16 < len; j += 16) {
            if (!key_block(s + j)) return 0;
        }
        return key_block(s + len - 16);
    }
#endif
    unsigned ok = 1;
    for (Py_ssize_t j = 0; j < len; j++) ok &= key_byte[s[j]];
    return (int)ok;
}

/* 1 when keys is a list; else 0 with a TypeError set (both functions take only lists: their
 * items are read in place, without a Python call that could change the list meanwhile). */
static int is_list(PyObject *keys, const char *function) {
    if (PyList_CheckExact(keys)) return 1;
    PyErr_Format(PyExc_TypeError, "%s: keys must be a list", function);
    return 0;
}

static PyObject *storage_keys_valid(PyObject *self, PyObject *keys) {
    (void)self;
    if (!is_list(keys, "storage_keys_valid")) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(key) || !PyUnicode_IS_COMPACT_ASCII(key)) Py_RETURN_FALSE;
        Py_ssize_t len = PyUnicode_GET_LENGTH(key);
        const unsigned char *s = (const unsigned char *)PyUnicode_DATA(key);
        if (len < 1 || len > MAX_KEY_LENGTH || s[0] == '_' || s[0] == '-') Py_RETURN_FALSE;
        if (!all_key_bytes(s, len)) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ---- XXH3-64, inputs of 0-240 bytes, seed 0 ------------------------------------------------- */

#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME_MX1 0x165667919E3779F9ULL
#define PRIME_MX2 0x9FB21C651E98DF25ULL

/* The first 136 bytes of the default secret (kSecret of the specification): all that inputs of
 * at most 240 bytes read. */
static const unsigned char SECRET[136] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3,
};

/* Little-endian reads at any alignment, whatever the host's byte order. */
static inline uint64_t read64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline uint32_t read32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t swap64(uint64_t x) {
    x = ((x << 8) & 0xFF00FF00FF00FF00ULL) | ((x >> 8) & 0x00FF00FF00FF00FFULL);
    x = ((x << 16) & 0xFFFF0000FFFF0000ULL) | ((x >> 16) & 0x0000FFFF0000FFFFULL);
    return (x << 32) | (x >> 32);
}

/* The 128-bit product of a and b, its two halves xor-ed. */
static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    uint64_t lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    uint64_t lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lower ^ upper;
#endif
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= PRIME64_2;
    h ^= h >> 29;
    h *= PRIME64_3;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PRIME_MX1;
    return h ^ (h >> 32);
}

static inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PRIME_MX2;
    h ^= (h >> 35) + len;
    h *= PRIME_MX2;
    return h ^ (h >> 28);
}

static inline uint64_t mix16(const unsigned char *in, const unsigned char *secret) {
    return mul128_fold64(read64(in) ^ read64(secret), read64(in + 8) ^ read64(secret + 8));
}

static uint64_t xxh3_64(const unsigned char *in, size_t len) {
    if (len == 0) return xxh64_avalanche(read64(SECRET + 56) ^ read64(SECRET + 64));
    if (len <= 3) {
        uint32_t combined = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) |
                            (uint32_t)in[len - 1] | ((uint32_t)len << 8);
        uint64_t bitflip = (uint64_t)(read32(SECRET) ^ read32(SECRET + 4));
        return xxh64_avalanche((uint64_t)combined ^ bitflip);
    }
    if (len <= 8) {
        uint64_t bitflip = read64(SECRET + 8) ^ read64(SECRET + 16);
        uint64_t input64 = (uint64_t)read32(in + len - 4) + ((uint64_t)read32(in) << 32);
        return rrmxmx(input64 ^ bitflip, len);
    }
    if (len <= 16) {
        uint64_t lo = read64(in) ^ (read64(SECRET + 24) ^ read64(SECRET + 32));
        uint64_t hi = read64(in + len - 8) ^ (read64(SECRET + 40) ^ read64(SECRET + 48));
        uint64_t acc = len + swap64(lo) + hi + mul128_fold64(lo, hi);
        return xxh3_avalanche(acc);
    }
    uint64_t acc = len * PRIME64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(in + 48, SECRET + 96);
                    acc += mix16(in + len - 64, SECRET + 112);
                }
                acc += mix16(in + 32, SECRET + 64);
                acc += mix16(in + len - 48, SECRET + 80);
            }
            acc += mix16(in + 16, SECRET + 32);
            acc += mix16(in + len - 32, SECRET + 48);
        }
        acc += mix16(in, SECRET);
        acc += mix16(in + len - 16, SECRET + 16);
        return xxh3_avalanche(acc);
    }
    /* 129-240 bytes */
    size_t rounds = len / 16;
    for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, SECRET + 16 * i);
    acc = xxh3_avalanche(acc);
    for (size_t i = 8; i < rounds; i++) acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, SECRET + 136 - 17);
    return xxh3_avalanche(acc);
}

static PyObject *xxh3_64_each(PyObject *self, PyObject *keys) {
    (void)self;
    if (!is_list(keys, "xxh3_64_each")) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL) return NULL;
    uint64_t *fps = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        const char *data;
        Py_ssize_t len;
        if (!PyUnicode_CheckExact(key)) goto fallback;
        if (PyUnicode_IS_COMPACT_ASCII(key)) { /* the common case: the characters are the bytes */
            data = (const char *)PyUnicode_DATA(key);
            len = PyUnicode_GET_LENGTH(key);
        } else {
            data = PyUnicode_AsUTF8AndSize(key, &len);
            if (data == NULL) {
                PyErr_Clear(); /* e.g. a lone surrogate: the caller's encode() raises it */
                goto fallback;
            }
        }
        if (len > MAX_HASHED) goto fallback;
        fps[i] = xxh3_64((const unsigned char *)data, (size_t)len);
    }
    return out;
fallback:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"storage_keys_valid", storage_keys_valid, METH_O,
     "storage_keys_valid(keys: list) -> bool: every item an exact str inside the storage-key "
     "grammar."},
    {"xxh3_64_each", xxh3_64_each, METH_O,
     "xxh3_64_each(keys: list[str]) -> bytes | None: native uint64 XXH3-64 of each key's UTF-8 "
     "(None: some key is not an exact str of at most 240 UTF-8 bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__keys(void) {
    init_key_bytes();
    return PyModule_Create(&module);
}
