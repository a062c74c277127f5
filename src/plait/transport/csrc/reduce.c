/* Element-wise reductions for the shared-memory engine (see reduce.h).
 *
 * Each kernel is a plain loop the compiler vectorises. On x86-64 every kernel is compiled
 * three times (AVX-512, AVX2/F16C, baseline SSE2) and the loader picks one for the CPU it
 * runs on (target_clones, resolved once through an ifunc): users get vector code without
 * -march=native, and a wheel built here runs on any x86-64. Other targets get one
 * portable build.
 *
 * Semantics follow numpy's ufuncs, which plait's Python reducers used before: signed
 * integers wrap (computed in unsigned arithmetic, so there is no undefined overflow),
 * MIN/MAX propagate NaN, bool is 0/1 with SUM/MAX = or, PROD/MIN = and.
 */
#include "reduce.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(PL_NO_CLONES)
#define PL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PL_CLONES
#endif

/* Elements per block: float16/bfloat16 blocks are widened into two float32 buffers of
 * this size on the stack (8 KiB each, well inside L1), and native types fold every row
 * into one output block while it is in L1. */
#define BLOCK 2048

size_t pl_itemsize(int dtype)
{
    static const size_t sizes[PL_NDTYPES] = {2, 2, 4, 8, 1, 1, 2, 4, 8, 1};
    return (dtype >= 0 && dtype < PL_NDTYPES) ? sizes[dtype] : 0;
}

int pl_reduce_defined(int dtype, int op)
{
    if (dtype < 0 || dtype >= PL_NDTYPES || op < 0 || op >= PL_NOPS)
        return 0;
    int floating = dtype == PL_F16 || dtype == PL_BF16 || dtype == PL_F32 || dtype == PL_F64;
    return !(floating && (op == PL_BAND || op == PL_BOR || op == PL_BXOR));
}

typedef void (*binfn)(void *o, const void *a, const void *b, size_t n);

/* -- kernels ------------------------------------------------------------------------- */

#define KERNEL(NAME, T, EXPR)                                                            \
    PL_CLONES static void NAME(void *o_, const void *a_, const void *b_, size_t n)       \
    {                                                                                    \
        T *o = o_;                                                                       \
        const T *a = a_, *b = b_;                                                        \
        for (size_t i = 0; i < n; i++) {                                                 \
            T x = a[i], y = b[i];                                                        \
            o[i] = (EXPR);                                                               \
        }                                                                                \
    }

/* floating: NaN in either operand gives NaN for MIN/MAX, as numpy's minimum/maximum */
#define FLOAT_KERNELS(S, T)                                                              \
    KERNEL(sum_##S, T, x + y)                                                            \
    KERNEL(prod_##S, T, x * y)                                                           \
    KERNEL(min_##S, T, x != x ? x : (x <= y ? x : y))                                    \
    KERNEL(max_##S, T, x != x ? x : (x >= y ? x : y))

/* integers: sum and product in the unsigned type of the same width (wrap-around) */
#define INT_KERNELS(S, T, U)                                                             \
    KERNEL(sum_##S, T, (T)((U)x + (U)y))                                                 \
    KERNEL(prod_##S, T, (T)((U)x * (U)y))                                                \
    KERNEL(min_##S, T, x < y ? x : y)                                                    \
    KERNEL(max_##S, T, x > y ? x : y)                                                    \
    KERNEL(band_##S, T, x & y)                                                           \
    KERNEL(bor_##S, T, x | y)                                                            \
    KERNEL(bxor_##S, T, x ^ y)

FLOAT_KERNELS(f32, float)
FLOAT_KERNELS(f64, double)
INT_KERNELS(i8, int8_t, uint8_t)
INT_KERNELS(u8, uint8_t, uint8_t)
INT_KERNELS(i16, int16_t, uint16_t)
INT_KERNELS(i32, int32_t, uint32_t)
INT_KERNELS(i64, int64_t, uint64_t)
/* bool bytes are 0 or 1: or, and, xor of them stay 0 or 1 */
KERNEL(or_b, uint8_t, x | y)
KERNEL(and_b, uint8_t, x & y)
KERNEL(xor_b, uint8_t, x ^ y)

#define INT_ROW(S) {sum_##S, prod_##S, min_##S, max_##S, band_##S, bor_##S, bxor_##S}

/* indexed [dtype][op]; float16 and bfloat16 use the float32 row on widened blocks */
static const binfn KERNELS[PL_NDTYPES][PL_NOPS] = {
    [PL_F16] = {sum_f32, prod_f32, min_f32, max_f32, 0, 0, 0},
    [PL_BF16] = {sum_f32, prod_f32, min_f32, max_f32, 0, 0, 0},
    [PL_F32] = {sum_f32, prod_f32, min_f32, max_f32, 0, 0, 0},
    [PL_F64] = {sum_f64, prod_f64, min_f64, max_f64, 0, 0, 0},
    [PL_I8] = INT_ROW(i8),
    [PL_U8] = INT_ROW(u8),
    [PL_I16] = INT_ROW(i16),
    [PL_I32] = INT_ROW(i32),
    [PL_I64] = INT_ROW(i64),
    [PL_BOOL] = {or_b, and_b, and_b, or_b, and_b, or_b, xor_b},
};

/* -- 16-bit floats ------------------------------------------------------------------- */

static inline uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

PL_CLONES static void widen_bf16(float *o, const uint16_t *a, size_t n)
{
    for (size_t i = 0; i < n; i++)
        o[i] = u2f((uint32_t)a[i] << 16);
}

/* round to nearest even; NaN becomes the quiet NaN torch produces (0x7FC0) */
PL_CLONES static void narrow_bf16(uint16_t *o, const float *a, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u = f2u(a[i]);
        uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        o[i] = (uint16_t)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? 0x7FC0u : r);
    }
}

#if defined(__FLT16_MANT_DIG__)
/* the compiler's _Float16: F16C instructions in the x86-64-v3/v4 clones */
PL_CLONES static void widen_f16(float *o, const uint16_t *a, size_t n)
{
    const _Float16 *h = (const _Float16 *)(const void *)a;
    for (size_t i = 0; i < n; i++)
        o[i] = (float)h[i];
}

PL_CLONES static void narrow_f16(uint16_t *o, const float *a, size_t n)
{
    _Float16 *h = (_Float16 *)(void *)o;
    for (size_t i = 0; i < n; i++)
        h[i] = (_Float16)a[i];
}
#else
/* portable IEEE binary16 conversions, round to nearest even */
static void widen_f16(float *o, const uint16_t *a, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t h = a[i], sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu,
                 mant = h & 0x3FFu;
        float f;
        if (exp == 0)
            f = (float)mant * 0x1p-24f;
        else if (exp == 31)
            f = u2f(0x7F800000u | (mant << 13));
        else
            f = u2f(((exp + 112u) << 23) | (mant << 13));
        o[i] = u2f(f2u(f) | sign);
    }
}

static void narrow_f16(uint16_t *o, const float *a, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t x = f2u(a[i]);
        uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
        x &= 0x7FFFFFFFu;
        uint16_t h;
        if (x > 0x7F800000u)
            h = 0x7E00u;
        else if (x >= 0x477FF000u) /* rounds to or beyond 65536: infinity */
            h = 0x7C00u;
        else if (x < 0x38800000u) /* below the smallest normal half: 2^-24 steps */
            h = (uint16_t)lrintf(u2f(x) * 0x1p24f);
        else
            h = (uint16_t)((x + 0xFFFu + ((x >> 13) & 1u) - 0x38000000u) >> 13);
        o[i] = sign | h;
    }
}
#endif

/* -- folding rows -------------------------------------------------------------------- */

static void fold_half(int dtype, binfn k, uint16_t *out, const void *const *rows, int n,
                      size_t count)
{
    float acc[BLOCK], tmp[BLOCK];
    void (*widen)(float *, const uint16_t *, size_t) =
        dtype == PL_BF16 ? widen_bf16 : widen_f16;
    void (*narrow)(uint16_t *, const float *, size_t) =
        dtype == PL_BF16 ? narrow_bf16 : narrow_f16;
    for (size_t off = 0; off < count; off += BLOCK) {
        size_t m = count - off < BLOCK ? count - off : BLOCK;
        widen(acc, (const uint16_t *)rows[0] + off, m);
        for (int r = 1; r < n; r++) {
            widen(tmp, (const uint16_t *)rows[r] + off, m);
            k(acc, acc, tmp, m);
        }
        narrow(out + off, acc, m);
    }
}

void pl_reduce_rows(int dtype, int op, void *out, const void *const *rows, int n,
                    size_t count)
{
    if (count == 0 || n <= 0 || !pl_reduce_defined(dtype, op))
        return;
    binfn k = KERNELS[dtype][op];
    if (dtype == PL_F16 || dtype == PL_BF16) {
        fold_half(dtype, k, out, rows, n, count);
        return;
    }
    size_t isz = pl_itemsize(dtype);
    if (n == 1) {
        if (out != rows[0])
            memmove(out, rows[0], count * isz);
        return;
    }
    /* block by block, so the output block stays in L1 while every row folds into it */
    size_t step = BLOCK * 8 / isz;
    for (size_t off = 0; off < count; off += step) {
        size_t m = count - off < step ? count - off : step;
        char *o = (char *)out + off * isz;
        k(o, (const char *)rows[0] + off * isz, (const char *)rows[1] + off * isz, m);
        for (int r = 2; r < n; r++)
            k(o, o, (const char *)rows[r] + off * isz, m);
    }
}
