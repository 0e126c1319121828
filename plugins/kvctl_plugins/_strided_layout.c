/* Loads LMCache chunks into a vLLM CPU block layout that is a strided view of each block (vec and vec16:
V row-major, K transposed), where kvctl's CPU connector finds one (cpu_connector.strided_layout).

vLLM's cpu_attn_reshape_and_cache writes a transposed K element by element over every head of a token
(~0.2x a plain copy of the bytes on AVX2). Here each run of slots inside one block goes in groups of 32
tokens, all heads: K in tiles of 8 tokens x 8 dims transposed in SSE2 registers, V one 16-byte load and
store at a time, every store a streaming store of an aligned 16 bytes (0.72x a plain copy, AVX2 or
AVX-512, 8 heads x 128 at block 16 or 128). A run's tokens before its first aligned tile and after its
last whole one go head by head with ordinary stores (head_run); so do layouts without aligned rows.

load(key, value, tokens, row, slots, cache, blocks, block_numel, block_size, heads, dims,
     k_offset, k_token, k_head, k_dim, v_offset, v_token, v_head, v_dim): key and value are addresses of
`tokens` rows of `row` 16-bit values (heads * dims of them used, contiguous); slots the address of `tokens`
int64 cache slots; cache the address of `blocks` blocks of `block_numel` values; the offsets and strides,
in values, say where (token, head, dim) of K and V lie inside a block. The caller (cpu_connector.py)
passes addresses of tensors it holds, of the dtypes and shapes it checked. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_ssize_t offset, token, head, dim;
} Strides;

#if defined(__SSE2__)
#include <emmintrin.h>
#define TILE 8
#define GROUP 4  /* tiles per streamed group: 32 tokens, one 64-byte line of each K row at block 128 */
/* 8 tokens (rows `row` apart) x 8 dims of one head, transposed in registers: out[j] holds dim j's 8 tokens. */
static void transpose_tile(const uint16_t *src, Py_ssize_t row, __m128i out[8]) {
    __m128i r[8], a[8], b[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm_loadu_si128((const __m128i *)(src + i * row));
    for (int i = 0; i < 8; i += 2) {
        a[i / 2] = _mm_unpacklo_epi16(r[i], r[i + 1]);      /* dims 0-3 of two tokens, interleaved */
        a[4 + i / 2] = _mm_unpackhi_epi16(r[i], r[i + 1]);  /* dims 4-7 */
    }
    for (int half = 0; half < 8; half += 4) {
        b[half] = _mm_unpacklo_epi32(a[half], a[half + 1]);          /* dims 0-1 (4-5) of tokens 0-3 */
        b[half + 1] = _mm_unpackhi_epi32(a[half], a[half + 1]);      /* dims 2-3 (6-7) of tokens 0-3 */
        b[half + 2] = _mm_unpacklo_epi32(a[half + 2], a[half + 3]);  /* the same of tokens 4-7 */
        b[half + 3] = _mm_unpackhi_epi32(a[half + 2], a[half + 3]);
    }
    for (int pair = 0; pair < 4; pair++) {  /* dims 2 pair and 2 pair + 1 of all 8 tokens */
        const int low = pair / 2 * 4 + pair % 2;
        out[2 * pair] = _mm_unpacklo_epi64(b[low], b[low + 2]);
        out[2 * pair + 1] = _mm_unpackhi_epi64(b[low], b[low + 2]);
    }
}

/* One tile into a block with ordinary stores: dim j's 8 tokens at out + j * stride. */
static void transposed_tile(const uint16_t *src, Py_ssize_t row, uint16_t *out, Py_ssize_t stride) {
    __m128i t[8];
    transpose_tile(src, row, t);
    for (int j = 0; j < 8; j++)
        _mm_storeu_si128((__m128i *)(out + j * stride), t[j]);
}

/* Tokens [0, count) of every head (count a multiple of TILE; the block's rows 16-byte aligned) written with
   streaming stores, GROUP tiles of tokens at a time. A load writes far more than the caches hold, and a
   streaming store skips reading each line before overwriting it; K's rows get whole lines (at block 128).
   The group's rows are read in order, heads inner: a head's slice of each row (rows 2 KiB apart at
   8 heads x 128) is a pattern the hardware prefetcher does not follow, and V read that way ran at half. */
static void streamed_run(uint16_t *block, const Strides *k, const Strides *v, const uint16_t *key,
                         const uint16_t *value, Py_ssize_t row, Py_ssize_t count, Py_ssize_t t0, Py_ssize_t heads,
                         Py_ssize_t dims) {
    for (Py_ssize_t first = 0; first < count; first += TILE * GROUP) {
        const Py_ssize_t tiles = (count - first) / TILE < GROUP ? (count - first) / TILE : GROUP;
        for (Py_ssize_t h = 0; h < heads; h++) {
            uint16_t *k_out = block + k->offset + h * k->head + (t0 + first) * k->token;
            for (Py_ssize_t d = 0; d < dims; d += TILE) {
                __m128i t[GROUP][8];
                for (Py_ssize_t g = 0; g < tiles; g++)
                    transpose_tile(key + (first + g * TILE) * row + h * dims + d, row, t[g]);
                for (int j = 0; j < 8; j++)  /* row d + j: the group's tokens, in order */
                    for (Py_ssize_t g = 0; g < tiles; g++)
                        _mm_stream_si128((__m128i *)(k_out + (d + j) * k->dim) + g, t[g][j]);
            }
        }
        for (Py_ssize_t i = first; i < first + tiles * TILE; i++)  /* V: each token's row, head after head */
            for (Py_ssize_t h = 0; h < heads; h++) {
                __m128i *out = (__m128i *)(block + v->offset + h * v->head + (t0 + i) * v->token);
                const __m128i *in = (const __m128i *)(value + i * row + h * dims);
                for (Py_ssize_t q = 0; q < dims / 8; q++)
                    _mm_stream_si128(out + q, _mm_loadu_si128(in + q));
            }
    }
}
#else
#define TILE 0
#endif

/* Tokens [0, count) of one head (rows `row` apart) into a block at token t0. */
static void head_run(uint16_t *block, const Strides *s, const uint16_t *src, Py_ssize_t row, Py_ssize_t count,
                     Py_ssize_t t0, Py_ssize_t h, Py_ssize_t dims) {
    uint16_t *base = block + s->offset + h * s->head + t0 * s->token;
    if (s->dim == 1) {
        for (Py_ssize_t i = 0; i < count; i++)
            memcpy(base + i * s->token, src + i * row, dims * sizeof *src);
    } else if (s->token == 1) {
        Py_ssize_t tiled = 0;
#if TILE
        if (dims % TILE == 0) {  /* every head size vLLM's CPU attention takes */
            tiled = count / TILE * TILE;
            for (Py_ssize_t d = 0; d < dims; d += TILE)  /* 8 of the block's K rows filled in order */
                for (Py_ssize_t t = 0; t < tiled; t += TILE)
                    transposed_tile(src + t * row + d, row, base + d * s->dim + t, s->dim);
        }
#endif
        for (Py_ssize_t first = tiled; first < count; first += 16) {
            const Py_ssize_t n = count - first < 16 ? count - first : 16;
            const uint16_t *rows = src + first * row;
            for (Py_ssize_t d = 0; d < dims; d++) {
                uint16_t *out = base + d * s->dim + first;
                for (Py_ssize_t i = 0; i < n; i++)
                    out[i] = rows[i * row + d];
            }
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            for (Py_ssize_t d = 0; d < dims; d++)
                base[i * s->token + d * s->dim] = src[i * row + d];
    }
}

static PyObject *load(PyObject *module_self, PyObject *args) {
    (void)module_self;
    unsigned long long key_address, value_address, slots_address, cache_address;
    Py_ssize_t tokens, row, blocks, block_numel, block_size, heads, dims;
    Strides k, v;
    if (!PyArg_ParseTuple(args, "KKnnKKnnnnnnnnnnnnn", &key_address, &value_address, &tokens, &row, &slots_address,
                          &cache_address, &blocks, &block_numel, &block_size, &heads, &dims, &k.offset, &k.token,
                          &k.head, &k.dim, &v.offset, &v.token, &v.head, &v.dim))
        return NULL;
    const Strides *both[2] = {&k, &v};
    for (int which = 0; which < 2; which++) {  /* every element a layout names lies inside its block */
        const Strides *s = both[which];
        if (s->offset < 0 || s->token < 0 || s->head < 0 || s->dim < 0 ||
            s->offset + (block_size - 1) * s->token + (heads - 1) * s->head + (dims - 1) * s->dim >= block_numel) {
            PyErr_SetString(PyExc_ValueError, "a layout that leaves its block");
            return NULL;
        }
    }
    if (tokens < 0 || row < heads * dims || block_size <= 0 || heads <= 0 || dims <= 0 || blocks <= 0) {
        PyErr_SetString(PyExc_ValueError, "a shape the strided layout does not have");
        return NULL;
    }
    const uint16_t *key = (const uint16_t *)(uintptr_t)key_address;
    const uint16_t *value = (const uint16_t *)(uintptr_t)value_address;
    const int64_t *slots = (const int64_t *)(uintptr_t)slots_address;
    uint16_t *cache = (uint16_t *)(uintptr_t)cache_address;
    for (Py_ssize_t i = 0; i < tokens; i++)
        if (slots[i] < 0 || slots[i] >= blocks * block_size) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the cache", (long long)slots[i]);
            return NULL;
        }
    /* Streaming stores need 16-byte aligned rows: every K row and V row of a block starts on 8 values. */
    const int streamable = TILE && k.token == 1 && v.dim == 1 && dims % 8 == 0 && (uintptr_t)cache % 16 == 0 &&
                           block_numel % 8 == 0 && k.offset % 8 == 0 && k.head % 8 == 0 && k.dim % 8 == 0 &&
                           v.offset % 8 == 0 && v.head % 8 == 0 && v.token % 8 == 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t first = 0, end; first < tokens; first = end) {  /* each run of slots inside one block */
        const Py_ssize_t t0 = slots[first] % block_size;
        end = first + 1;
        while (end < tokens && slots[end] == slots[end - 1] + 1 && slots[end] % block_size != 0)
            end++;
        uint16_t *block = cache + (slots[first] / block_size) * block_numel;
        const Py_ssize_t count = end - first, to_aligned = (TILE - t0 % TILE) % TILE;
        /* the run's tokens [lead, tail) are streamed, where the run reaches whole tiles on aligned rows */
        const Py_ssize_t lead = streamable ? (to_aligned < count ? to_aligned : count) : count;
        const Py_ssize_t tail = streamable ? lead + (count - lead) / TILE * TILE : count;
        for (Py_ssize_t h = 0; h < heads; h++) {
            const uint16_t *rows[2] = {key + first * row + h * dims, value + first * row + h * dims};
            for (int which = 0; which < 2; which++) {
                head_run(block, both[which], rows[which], row, lead, t0, h, dims);
                head_run(block, both[which], rows[which] + tail * row, row, count - tail, t0 + tail, h, dims);
            }
        }
#if TILE
        if (tail > lead)
            streamed_run(block, &k, &v, key + (first + lead) * row, value + (first + lead) * row, row, tail - lead,
                         t0 + lead, heads, dims);
#endif
    }
#if TILE
    _mm_sfence();  /* the streamed lines are visible before vLLM reads them */
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "LMCache rows of K and V into a strided vLLM CPU block layout, per slot."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_strided_layout", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__strided_layout(void) { return PyModule_Create(&module); }
