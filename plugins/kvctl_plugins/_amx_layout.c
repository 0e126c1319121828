/* Loads LMCache chunks into vLLM CPU's AMX block layout, where kvctl's CPU connector finds that layout.

vLLM CPU's AMX attention (bf16, blocks of a multiple of 32 tokens) keeps each head of a block as K
then V, B tokens x D dims each, in tile order (cpu_connector.amx_layout writes the same formulas, and
the connector uses this only when they equal the layout it probes from vLLM's own kernel):
  K: (t / 16) * 16 D + (d / 2) * 32 + (t % 16) * 2 + d % 2       pairs of dims, 16 tokens per tile
  V: B D + (d / 16) * 16 B + (t / 2) * 32 + (d % 16) * 2 + t % 2  pairs of tokens, 16 dims per tile
vLLM's cpu_attn_reshape_and_cache writes it element by element (~0.4x a plain copy of the bytes). Here
a whole tile's 64-byte lines are assembled in registers and streamed to memory (~0.9x); partial tiles
take one 32-bit store per K pair of dims and per V pair of tokens.

load(key, value, tokens, row, slots, cache, blocks, heads, block_size, head_size): key and value are
addresses of `tokens` rows of `row` bf16 values (heads * head_size of them used, contiguous); slots the
address of `tokens` int64 cache slots; cache the address of `blocks` blocks of the layer. The caller
(cpu_connector.py) passes addresses of tensors it holds, of the dtypes and shapes it checked. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Where one head of one block lives, and its shape. */
typedef struct {
    uint16_t *head;      /* the head's K region; V follows at block * dims */
    Py_ssize_t block, dims;
} Tiles;

/* K of one token (t: its place in the block): one 32-bit store per pair of dims. */
static void key_token(const Tiles *to, const uint16_t *k, Py_ssize_t t) {
    uint32_t *out = (uint32_t *)(to->head + (t / 16) * 16 * to->dims + (t % 16) * 2);
    for (Py_ssize_t d = 0; d < to->dims; d += 2) {
        uint32_t pair;
        memcpy(&pair, k + d, sizeof pair);
        out[(d / 2) * 16] = pair;
    }
}

/* V of one token on its own (its pair is elsewhere or absent): one 16-bit store per dim. */
static void value_token(const Tiles *to, const uint16_t *v, Py_ssize_t t) {
    uint16_t *out = to->head + to->block * to->dims + (t / 2) * 32 + t % 2;
    for (Py_ssize_t d = 0; d < to->dims; d++)
        out[(d / 16) * 16 * to->block + (d % 16) * 2] = v[d];
}

/* V of tokens t and t + 1 (t even), which share V's rows: one 32-bit store per dim for both. */
static void value_pair(const Tiles *to, const uint16_t *v, const uint16_t *next, Py_ssize_t t) {
    uint16_t *out = to->head + to->block * to->dims + (t / 2) * 32;
    for (Py_ssize_t d = 0; d < to->dims; d++) {
        uint32_t pair = (uint32_t)v[d] | (uint32_t)next[d] << 16;
        memcpy(out + (d / 16) * 16 * to->block + (d % 16) * 2, &pair, sizeof pair);
    }
}

#if defined(__SSE2__)
#include <emmintrin.h>
#define WHOLE_TILES 1
/* A whole tile: 16 tokens of one head from t (t % 16 == 0), rows `row` apart. Each 64-byte line of K (a
   pair of dims of the 16 tokens) and of V (16 dims of a pair of tokens) is assembled in registers and
   streamed to memory: no line is read before it is written, as a plain copy's are not. */
static void whole_tile(const Tiles *to, const uint16_t *k, const uint16_t *v, Py_ssize_t row, Py_ssize_t t) {
    uint16_t *key_lines = to->head + (t / 16) * 16 * to->dims;
    for (Py_ssize_t d = 0; d < to->dims; d += 2) {
        uint32_t line[16];
        for (int j = 0; j < 16; j++)
            memcpy(&line[j], k + j * row + d, sizeof line[j]);
        __m128i *out = (__m128i *)(key_lines + (d / 2) * 32);
        for (int q = 0; q < 4; q++)
            _mm_stream_si128(out + q, _mm_loadu_si128((const __m128i *)line + q));
    }
    for (int j = 0; j < 16; j += 2) {
        const uint16_t *a = v + j * row, *b = a + row;
        uint16_t *value_lines = to->head + to->block * to->dims + ((t + j) / 2) * 32;
        for (Py_ssize_t d = 0; d < to->dims; d += 16) {
            __m128i a0 = _mm_loadu_si128((const __m128i *)(a + d)), a1 = _mm_loadu_si128((const __m128i *)(a + d + 8));
            __m128i b0 = _mm_loadu_si128((const __m128i *)(b + d)), b1 = _mm_loadu_si128((const __m128i *)(b + d + 8));
            __m128i *out = (__m128i *)(value_lines + (d / 16) * 16 * to->block);
            _mm_stream_si128(out, _mm_unpacklo_epi16(a0, b0));
            _mm_stream_si128(out + 1, _mm_unpackhi_epi16(a0, b0));
            _mm_stream_si128(out + 2, _mm_unpacklo_epi16(a1, b1));
            _mm_stream_si128(out + 3, _mm_unpackhi_epi16(a1, b1));
        }
    }
}
#else
#define WHOLE_TILES 0
#endif

static int parse(PyObject *args, uintptr_t *key, uintptr_t *value, Py_ssize_t *tokens, Py_ssize_t *row,
                 uintptr_t *slots, uintptr_t *cache, Py_ssize_t *blocks, Py_ssize_t *heads, Py_ssize_t *block,
                 Py_ssize_t *dims) {
    unsigned long long k, v, s, c;
    if (!PyArg_ParseTuple(args, "KKnnKKnnnn", &k, &v, tokens, row, &s, &c, blocks, heads, block, dims))
        return 0;
    *key = (uintptr_t)k, *value = (uintptr_t)v, *slots = (uintptr_t)s, *cache = (uintptr_t)c;
    if (*block <= 0 || *block % 32 || *dims <= 0 || *dims % 16 || *heads <= 0 || *tokens < 0 ||
        *row < *heads * *dims || *blocks <= 0) {
        PyErr_SetString(PyExc_ValueError, "a shape the AMX layout does not have");
        return 0;
    }
    return 1;
}

static PyObject *load(PyObject *self, PyObject *args) {
    uintptr_t key_address, value_address, slots_address, cache_address;
    Py_ssize_t tokens, row, blocks, heads, block, dims;
    if (!parse(args, &key_address, &value_address, &tokens, &row, &slots_address, &cache_address, &blocks,
               &heads, &block, &dims))
        return NULL;
    const uint16_t *key = (const uint16_t *)key_address, *value = (const uint16_t *)value_address;
    const int64_t *slots = (const int64_t *)slots_address;
    uint16_t *cache = (uint16_t *)cache_address;
    const Py_ssize_t head_span = 2 * block * dims, block_span = heads * head_span;
    for (Py_ssize_t i = 0; i < tokens; i++)
        if (slots[i] < 0 || slots[i] >= blocks * block) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the cache", (long long)slots[i]);
            return NULL;
        }
#if WHOLE_TILES
    const int streamable = cache_address % 64 == 0;  /* then every line of the layout is 64-byte aligned */
#endif
    Py_BEGIN_ALLOW_THREADS
    /* Tile by tile of the cache (up to 16 tokens), head by head inside: the tokens' rows stay in L1 and are
       read in order, and a head's lines fill before they leave L1. (Token by token with every head inside,
       the heads, 2 B D values apart, fall in the same cache sets and evict each other.) */
    for (Py_ssize_t first = 0, end; first < tokens; first = end) {
        const Py_ssize_t t0 = slots[first] % block;
        end = first + 1;
        while (end < tokens && end - first < 16 - t0 % 16 && slots[end] == slots[end - 1] + 1)
            end++;
#if WHOLE_TILES
        const int whole = streamable && t0 % 16 == 0 && end - first == 16;
#endif
        for (Py_ssize_t h = 0; h < heads; h++) {
            const Tiles to = {cache + (slots[first] / block) * block_span + h * head_span, block, dims};
            const uint16_t *k = key + first * row + h * dims, *v = value + first * row + h * dims;
#if WHOLE_TILES
            if (whole) {
                whole_tile(&to, k, v, row, t0);
                continue;
            }
#endif
            for (Py_ssize_t i = 0; i < end - first; i++) {
                const Py_ssize_t t = t0 + i;
                key_token(&to, k + i * row, t);
                if (t % 2 == 0 && i + 1 < end - first) {
                    key_token(&to, k + (i + 1) * row, t + 1);
                    value_pair(&to, v + i * row, v + (i + 1) * row, t);
                    i++;
                } else {
                    value_token(&to, v + i * row, t);
                }
            }
        }
    }
#if WHOLE_TILES
    _mm_sfence();  /* the streamed lines are in memory before anyone reads the cache */
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "LMCache rows of K and V into vLLM CPU's AMX block layout, per slot."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_amx_layout", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__amx_layout(void) { return PyModule_Create(&module); }
