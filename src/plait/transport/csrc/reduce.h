/* Element-wise reductions of the shared-memory engine: every (dtype, op) of plait's table.
 *
 * The codes are plait's order (plait/transport/engine.py maps names to them). AVG is not
 * an op here: it is SUM followed by a division, done once by the caller.
 */
#ifndef PLAIT_REDUCE_H
#define PLAIT_REDUCE_H

#include <stddef.h>

enum pl_dtype {
    PL_F16, PL_BF16, PL_F32, PL_F64, PL_I8, PL_U8, PL_I16, PL_I32, PL_I64, PL_BOOL,
    PL_NDTYPES
};

enum pl_op { PL_SUM, PL_PROD, PL_MIN, PL_MAX, PL_BAND, PL_BOR, PL_BXOR, PL_NOPS };

/* Bytes per element of a dtype code, or 0 for an unknown code. */
size_t pl_itemsize(int dtype);

/* Whether (dtype, op) is defined: bitwise ops need integers or bool. */
int pl_reduce_defined(int dtype, int op);

/* out[i] = rows[0][i] op rows[1][i] op ... op rows[n-1][i] for i < count, folded in row
 * order, so every rank that reduces the same rows gets the same bits. float16 and
 * bfloat16 are accumulated in float32 and rounded once at the end. ``out`` may be
 * rows[0]; it must not overlap any other row. */
void pl_reduce_rows(int dtype, int op, void *out, const void *const *rows, int n,
                    size_t count);

#endif
