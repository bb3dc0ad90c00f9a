/* What odtrain's kernel library links besides its kernels (odtrain/library_build/link.py).

The kernels are Numba code emitted into one object. Numba's JIT hands that code the addresses of its
parallel launcher and scheduler, of a few runtime and GIL helpers and of the BLAS products; a shared
library needs them as symbols. This file supplies them, hidden (the library's own references bind to
them, never to a Numba or CPython of the process), plus two exported entry points:

- odtrain_run(n, functions, blocks, threads): calls functions[i](blocks[i]) in order, each an
  `int32 k(void **arguments)` wrapper; returns the index of the first call that failed, or -1. Called
  through ctypes, which releases the GIL for the whole list.
- odtrain_set_gemm(sgemm, dgemm): the BLAS behind the kernels' products (odtrain_cblas_?gemm, the ABI
  of OpenBLAS's 64-bit-integer cblas_?gemm), set once by the loader.

Parallel regions run on OpenMP. The schedule of a region follows Numba's: one division per thread,
a 1-D range split into consecutive blocks of ceil(remaining / threads left) iterations. A kernel's
parts are fixed by its arguments, so which thread runs which part never changes a result.
GNU OpenMP does not survive fork(): a child forked after a region runs every region on its calling
thread (odtrain_regions_forked() tells the loader).
*/
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <alloca.h>
#include <string.h>
#include <stdio.h>
#include <pthread.h>
#include <omp.h>

#ifndef HIDDEN  /* tests build it with -DHIDDEN= to call the helpers */
#define HIDDEN __attribute__((visibility("hidden")))
#endif
#define EXPORT __attribute__((visibility("default")))

typedef int32_t (*kernel_fn)(void **arguments);
typedef void (*gufunc_fn)(char **args, size_t *dims, size_t *steps, void *data);

static __thread intptr_t thread_count = 1;      /* the threads a region of this thread may use */
static __thread uintptr_t chunk_size = 0;
static int regions_started = 0;
static int forked_after_regions = 0;
static pthread_once_t fork_guard = PTHREAD_ONCE_INIT;

static void in_child(void) { if (regions_started) forked_after_regions = 1; }
static void install_fork_guard(void) { pthread_atfork(NULL, NULL, in_child); }

/* ---- the launcher that Numba's parallel code calls ---- */

HIDDEN intptr_t get_num_threads(void) { return thread_count; }
HIDDEN intptr_t get_thread_id(void) { return omp_get_thread_num(); }
HIDDEN void set_num_threads(intptr_t count) { thread_count = count; }
HIDDEN uintptr_t get_parallel_chunksize(void) { return chunk_size; }
HIDDEN void set_parallel_chunksize(uintptr_t size) { chunk_size = size; }

HIDDEN uintptr_t get_sched_size(uintptr_t threads, uintptr_t num_dim, intptr_t *starts, intptr_t *ends) {
    (void)num_dim; (void)starts; (void)ends;
    return threads;  /* one division per thread (odtrain's kernels never set a chunk size) */
}

HIDDEN intptr_t *allocate_sched(uintptr_t entries) { return (intptr_t *)malloc(entries * sizeof(intptr_t) + 1); }
HIDDEN void deallocate_sched(intptr_t *schedule) { free(schedule); }

/* Division d of `divisions` over dimension `axis` (the longest) takes a consecutive block; the other
   dimensions whole. Entries: starts[num_dim] then ends[num_dim], inclusive; an empty division is 1..0. */
static void schedule(uintptr_t num_dim, const intptr_t *starts, const intptr_t *ends, uintptr_t divisions,
                     intptr_t *out) {
    uintptr_t axis = 0;
    intptr_t longest = -1;
    for (uintptr_t j = 0; j < num_dim; j++) {
        intptr_t length = ends[j] - starts[j] + 1;
        if (length > longest) { longest = length; axis = j; }
    }
    intptr_t length = longest < 0 ? 0 : longest, done = 0;
    for (uintptr_t d = 0; d < divisions; d++) {
        intptr_t *entry = out + d * num_dim * 2;
        intptr_t size = length <= (intptr_t)divisions ? (d < (uintptr_t)length ? 1 : 0)
                                                       : (length - done - 1) / (intptr_t)(divisions - d) + 1;
        if (d == divisions - 1 && length > (intptr_t)divisions) size = length - done;
        for (uintptr_t j = 0; j < num_dim; j++) { entry[j] = starts[j]; entry[num_dim + j] = ends[j]; }
        if (size == 0) {
            for (uintptr_t j = 0; j < num_dim; j++) { entry[j] = 1; entry[num_dim + j] = 0; }
        } else {
            entry[axis] = starts[axis] + done;
            entry[num_dim + axis] = starts[axis] + done + size - 1;
        }
        done += size;
    }
}

HIDDEN void do_scheduling_signed(uintptr_t num_dim, intptr_t *starts, intptr_t *ends, uintptr_t divisions,
                                 intptr_t *out, intptr_t debug) {
    (void)debug;
    if (divisions) schedule(num_dim, starts, ends, divisions, out);
}

HIDDEN void do_scheduling_unsigned(uintptr_t num_dim, intptr_t *starts, intptr_t *ends, uintptr_t divisions,
                                   uintptr_t *out, intptr_t debug) {
    (void)debug;
    if (divisions) schedule(num_dim, starts, ends, divisions, (intptr_t *)out);
}

static void run_division(gufunc_fn fn, char **args, size_t *dimensions, size_t *steps, void *data,
                         size_t inner_ndim, size_t array_count, ptrdiff_t r, size_t *counts, char **pointers) {
    memcpy(counts, dimensions, (inner_ndim + 1) * sizeof(size_t));
    counts[0] = 1;
    for (size_t j = 0; j < array_count; j++)
        pointers[j] = args[j] ? args[j] + (ptrdiff_t)steps[j] * r : args[j];
    fn(pointers, counts, steps, data);
}

HIDDEN void numba_parallel_for(void *function, char **args, size_t *dimensions, size_t *steps, void *data,
                               size_t inner_ndim, size_t array_count, intptr_t threads) {
    gufunc_fn fn = (gufunc_fn)function;
    ptrdiff_t size = (ptrdiff_t)dimensions[0];
    if (forked_after_regions || threads <= 1) {
        size_t *counts = (size_t *)alloca(sizeof(size_t) * (inner_ndim + 1));
        char **pointers = (char **)alloca(sizeof(char *) * array_count);
        for (ptrdiff_t r = 0; r < size; r++)
            run_division(fn, args, dimensions, steps, data, inner_ndim, array_count, r, counts, pointers);
        return;
    }
    pthread_once(&fork_guard, install_fork_guard);
    regions_started = 1;
    #pragma omp parallel num_threads((int)threads)
    {
        size_t *counts = (size_t *)alloca(sizeof(size_t) * (inner_ndim + 1));
        char **pointers = (char **)alloca(sizeof(char *) * array_count);
        thread_count = threads;
        #pragma omp for schedule(static)
        for (ptrdiff_t r = 0; r < size; r++)
            run_division(fn, args, dimensions, steps, data, inner_ndim, array_count, r, counts, pointers);
    }
}

/* ---- the GIL helpers around a parallel region: the runner already runs without the GIL ---- */

HIDDEN void numba_gil_ensure(void *state) { (void)state; }
HIDDEN void numba_gil_release(void *state) { (void)state; }
HIDDEN void *PyEval_SaveThread(void) { return NULL; }
HIDDEN void PyEval_RestoreThread(void *state) { (void)state; }

/* ---- Numba's memory blocks (reductions allocate their per-thread partial results) ---- */

typedef void (*destructor)(void *data, size_t size, void *info);
typedef struct {
    size_t refcount;
    destructor dtor;
    void *dtor_info;
    void *data;
    size_t size;
    void *external_allocator;
} memory_block;

static void free_data(void *data, size_t size, void *info) { (void)size; (void)data; free(info); }

HIDDEN memory_block *NRT_MemInfo_alloc_aligned(size_t size, unsigned align) {
    memory_block *block = (memory_block *)malloc(sizeof(memory_block));
    void *base = malloc(size + 2 * (size_t)align);
    if (!block || !base) { free(block); free(base); return NULL; }
    uintptr_t address = (uintptr_t)base, rest = align ? address % align : 0;
    block->refcount = 1;
    block->dtor = free_data;
    block->dtor_info = base;
    block->data = (void *)(rest ? address + align - rest : address);
    block->size = size;
    block->external_allocator = NULL;
    return block;
}

HIDDEN memory_block *NRT_MemInfo_alloc_safe_aligned(size_t size, unsigned align) {
    return NRT_MemInfo_alloc_aligned(size, align);
}

HIDDEN void NRT_MemInfo_call_dtor(memory_block *block) {
    if (block->dtor) block->dtor(block->data, block->size, block->dtor_info);
    free(block);
}

HIDDEN void *NRT_Allocate(size_t size) { return malloc(size); }
HIDDEN void NRT_Free(void *pointer) { free(pointer); }

/* ---- the reshape of a strided view without a copy (Numba's `reshape` on an 'A' array) ----
   Returns 1 and the new strides when the view can be reshaped in place, else 0. The old axes are grouped
   with the new ones into runs of equal element counts; each run of old axes must be one contiguous block
   (in the order asked), and the new axes of that run take strides within it. Axes of length 1 have no
   stride that matters. */

HIDDEN int numba_attempt_nocopy_reshape(intptr_t nd, const intptr_t *dims, const intptr_t *strides,
                                        intptr_t newnd, const intptr_t *newdims, intptr_t *newstrides,
                                        intptr_t itemsize, int is_f_order) {
    intptr_t olddims[64], oldstrides[64], old_count = 1, new_count = 1;
    int oldnd = 0;
    if (nd > 64) return 0;
    for (int i = 0; i < nd; i++) {
        if (dims[i] != 1) { olddims[oldnd] = dims[i]; oldstrides[oldnd] = strides[i]; oldnd++; }
    }
    for (int i = 0; i < oldnd; i++) old_count *= olddims[i];
    for (int i = 0; i < newnd; i++) new_count *= newdims[i];
    if (old_count != new_count) return 0;
    if (new_count == 0) {  /* an empty view: any strides do */
        for (int i = 0; i < newnd; i++) newstrides[i] = itemsize;
        return 1;
    }
    int oi = 0, oj = 1, ni = 0, nj = 1;
    while (ni < newnd && oi < oldnd) {
        intptr_t new_run = newdims[ni], old_run = olddims[oi];
        while (new_run != old_run) {
            if (new_run < old_run) new_run *= newdims[nj++];
            else old_run *= olddims[oj++];
        }
        for (int k = oi; k < oj - 1; k++) {  /* the old run must be one block */
            if (is_f_order ? oldstrides[k + 1] != olddims[k] * oldstrides[k]
                           : oldstrides[k] != olddims[k + 1] * oldstrides[k + 1]) return 0;
        }
        if (is_f_order) {
            newstrides[ni] = oldstrides[oi];
            for (int k = ni + 1; k < nj; k++) newstrides[k] = newstrides[k - 1] * newdims[k - 1];
        } else {
            newstrides[nj - 1] = oldstrides[oj - 1];
            for (int k = nj - 1; k > ni; k--) newstrides[k - 1] = newstrides[k] * newdims[k];
        }
        ni = nj++;
        oi = oj++;
    }
    intptr_t last = itemsize;  /* trailing new axes of length 1 */
    if (ni >= 1) last = is_f_order ? newstrides[ni - 1] * newdims[ni - 1] : newstrides[ni - 1];
    for (int k = ni; k < newnd; k++) newstrides[k] = last;
    return 1;
}

/* ---- BLAS ---- */

typedef void (*sgemm_fn)(int32_t, int32_t, int32_t, int64_t, int64_t, int64_t, float, const float *, int64_t,
                         const float *, int64_t, float, float *, int64_t);
typedef void (*dgemm_fn)(int32_t, int32_t, int32_t, int64_t, int64_t, int64_t, double, const double *, int64_t,
                         const double *, int64_t, double, double *, int64_t);
static sgemm_fn sgemm;
static dgemm_fn dgemm;

HIDDEN void odtrain_cblas_sgemm(int32_t order, int32_t ta, int32_t tb, int64_t m, int64_t n, int64_t k, float alpha,
                                const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                                int64_t ldc) {
    sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

HIDDEN void odtrain_cblas_dgemm(int32_t order, int32_t ta, int32_t tb, int64_t m, int64_t n, int64_t k, double alpha,
                                const double *a, int64_t lda, const double *b, int64_t ldb, double beta, double *c,
                                int64_t ldc) {
    dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* ---- entry points ---- */

EXPORT void odtrain_set_gemm(void *single, void *twice) {
    sgemm = (sgemm_fn)single;
    dgemm = (dgemm_fn)twice;
}

EXPORT int32_t odtrain_regions_forked(void) { return forked_after_regions; }

EXPORT int64_t odtrain_run(int64_t n, void **functions, void **blocks, int64_t threads) {
    intptr_t previous = thread_count;
    thread_count = forked_after_regions ? 1 : (intptr_t)threads;
    int64_t failed = -1;
    for (int64_t i = 0; i < n; i++) {
        if (((kernel_fn)functions[i])((void **)blocks[i]) != 0) {
            failed = i;
            break;
        }
    }
    thread_count = previous;
    return failed;
}
