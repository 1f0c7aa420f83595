// The fake cuBLAS of the fake CUDA driver (driver.cpp): handles, their stream, and
// cublasGemmEx with cuBLAS's column-major contract, so that the CUDA backend's cuBLAS
// calls (operand order, transposes, leading dimensions, beta) run and are checked
// without a GPU. Built as a shared library whose soname is `libcublas.so`, after
// runtime.h and common.cuh (for the dtype conversions); its GEMMs run in order on the
// handle's stream through the fake driver (`cmm_fake_enqueue`).
//
// The arithmetic: every product in f32 (exact for f16 and bf16 inputs), summed in k
// order in f32, then C = alpha·sum + beta·C, rounded once to C's dtype. With beta = 0, C
// is not read (it may hold anything, as cuBLAS allows).

#include <mutex>
#include <set>
#include <string>

extern "C" int cmm_fake_enqueue(void* stream, void (*work)(void*), void* arg, void (*release)(void*));
extern "C" int cmm_fake_accessible(u64 addr, u64 bytes);
extern "C" int cmm_fake_load_code(void* stream);

namespace cmm_fake_blas {

enum : int { SUCCESS = 0, NOT_INITIALIZED = 1, INVALID_VALUE = 7, EXECUTION_FAILED = 13, NOT_SUPPORTED = 15 };

struct Handle {
    void* stream = nullptr;
    bool live = true;
};

struct Gemm {
    int trans_a, trans_b, m, n, k;
    float alpha, beta;
    u64 a, b, c;
    u32 ta, tb, tc;  // cmm dtype codes: 0 f32, 1 f16, 2 bf16
    int lda, ldb, ldc;
};

// cudaDataType -> cmm's dtype code.
inline int dtype_of(int cuda_type) {
    switch (cuda_type) {
        case 0: return 0;   // CUDA_R_32F
        case 2: return 1;   // CUDA_R_16F
        case 14: return 2;  // CUDA_R_16BF
        default: return -1;
    }
}

inline u64 size_of(u32 dtype) { return dtype == 0 ? 4 : 2; }

// op(X) is rows × cols; X is stored column-major with leading dimension ld.
inline float element(u64 base, u32 dtype, int ld, bool trans, int row, int col) {
    u64 index = trans ? (u64)col + (u64)row * ld : (u64)row + (u64)col * ld;
    return cmm_load(base, index, dtype);
}

inline void run(void* arg) {
    const Gemm& g = *static_cast<Gemm*>(arg);
    // op(A) and op(B) decoded once into dense row-major f32; then a row of C at a time,
    // each element still summed in k order (the loop over j only runs the k steps of
    // many elements side by side).
    std::vector<float> a((size_t)g.m * g.k), b((size_t)g.k * g.n), sum(g.n);
    for (int i = 0; i < g.m; ++i)
        for (int l = 0; l < g.k; ++l) a[(size_t)i * g.k + l] = element(g.a, g.ta, g.lda, g.trans_a != 0, i, l);
    for (int l = 0; l < g.k; ++l)
        for (int j = 0; j < g.n; ++j) b[(size_t)l * g.n + j] = element(g.b, g.tb, g.ldb, g.trans_b != 0, l, j);
    for (int i = 0; i < g.m; ++i) {
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int l = 0; l < g.k; ++l) {
            const float x = a[(size_t)i * g.k + l];
            const float* row = &b[(size_t)l * g.n];
            for (int j = 0; j < g.n; ++j) sum[j] = __fadd_rn(sum[j], __fmul_rn(x, row[j]));
        }
        for (int j = 0; j < g.n; ++j) {
            u64 at = (u64)i + (u64)j * g.ldc;
            float out = __fmul_rn(g.alpha, sum[j]);
            if (g.beta != 0.0f) out = __fadd_rn(out, __fmul_rn(g.beta, cmm_load(g.c, at, g.tc)));
            cmm_store_bits(g.c, at, g.tc, cmm_encode(out, g.tc));
        }
    }
}

inline void release(void* arg) { delete static_cast<Gemm*>(arg); }

// cuBLASLt loads the kernels for a GEMM the first time it meets its shape, whatever
// CUDA_MODULE_LOADING says, and the load waits for the context's running work (seen on
// an H100: cuLibraryLoadData inside cublasGemmEx). The shapes met so far, by what picks
// a kernel: transposes, sizes, dtypes, leading dimensions, 16-byte alignment.
std::mutex loaded_lock;
std::set<std::string> loaded;

inline std::string shape_of(const Gemm& g) {
    char key[160];
    std::snprintf(key, sizeof key, "%d %d %d %d %d %u %u %d %d %d %d %d %d", g.trans_a, g.trans_b, g.m, g.n, g.k, g.ta,
                  g.tc, g.lda, g.ldb, g.ldc, (int)(g.a % 16), (int)(g.b % 16), (int)(g.c % 16));
    return key;
}

// Bytes from the first to one past the last element of a column-major rows × cols
// matrix with leading dimension ld.
inline u64 span(int rows, int cols, int ld, u32 dtype) {
    if (rows == 0 || cols == 0) return 0;
    return ((u64)(cols - 1) * ld + rows) * size_of(dtype);
}

}  // namespace cmm_fake_blas

using namespace cmm_fake_blas;

extern "C" {

int cublasCreate_v2(Handle** out) {
    if (out == nullptr) return INVALID_VALUE;
    *out = new Handle();
    return SUCCESS;
}

int cublasDestroy_v2(Handle* h) {
    if (h == nullptr || !h->live) return NOT_INITIALIZED;
    h->live = false;  // kept: a queued GEMM does not refer to it, but a stale handle must fail
    return SUCCESS;
}

int cublasSetStream_v2(Handle* h, void* stream) {
    if (h == nullptr || !h->live) return NOT_INITIALIZED;
    h->stream = stream;
    return SUCCESS;
}

int cublasSetWorkspace_v2(Handle* h, void* workspace, size_t bytes) {
    if (h == nullptr || !h->live) return NOT_INITIALIZED;
    if (workspace == nullptr && bytes != 0) return INVALID_VALUE;
    return SUCCESS;
}

int cublasGetStream_v2(Handle* h, void** stream) {
    if (h == nullptr || !h->live) return NOT_INITIALIZED;
    *stream = h->stream;
    return SUCCESS;
}

int cublasGemmEx(Handle* h, int transa, int transb, int m, int n, int k, const void* alpha, const void* a, int atype,
                 int lda, const void* b, int btype, int ldb, const void* beta, void* c, int ctype, int ldc,
                 int compute, int algo) {
    if (h == nullptr || !h->live) return NOT_INITIALIZED;
    if (transa < 0 || transa > 1 || transb < 0 || transb > 1 || m < 0 || n < 0 || k < 0) return INVALID_VALUE;
    // The compute type decides how alpha and beta are read: host floats for COMPUTE_32F.
    if (compute != 68 || algo != -1) return NOT_SUPPORTED;
    int ta = dtype_of(atype), tb = dtype_of(btype), tc = dtype_of(ctype);
    if (ta < 0 || tb < 0 || tc < 0 || ta != tb) return NOT_SUPPORTED;
    // Stored shapes: A is m × k (k × m transposed), B is k × n (n × k transposed).
    int a_rows = transa ? k : m, b_rows = transb ? n : k;
    if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1)) {
        return INVALID_VALUE;
    }
    if (m == 0 || n == 0) return SUCCESS;
    Gemm* g = new Gemm{transa, transb, m, n, k, *(const float*)alpha, *(const float*)beta, (u64)a, (u64)b, (u64)c,
                       (u32)ta, (u32)tb, (u32)tc, lda, ldb, ldc};
    bool in_bounds = cmm_fake_accessible(g->a, span(a_rows, transa ? m : k, lda, g->ta)) &&
                     cmm_fake_accessible(g->b, span(b_rows, transb ? k : n, ldb, g->tb)) &&
                     cmm_fake_accessible(g->c, span(m, n, ldc, g->tc));
    if (!in_bounds) {
        delete g;
        return INVALID_VALUE;
    }
    bool first;
    {
        std::lock_guard<std::mutex> guard(loaded_lock);
        first = loaded.insert(shape_of(*g)).second;
    }
    if (first && cmm_fake_load_code(h->stream) != 0) {
        delete g;
        return EXECUTION_FAILED;
    }
    if (cmm_fake_enqueue(h->stream, run, g, release) != 0) {
        delete g;
        return EXECUTION_FAILED;
    }
    return SUCCESS;
}

// For tests: cuBLAS forgets every shape it has loaded kernels for.
void cmm_fake_blas_forget_loaded() {
    std::lock_guard<std::mutex> guard(loaded_lock);
    loaded.clear();
}

}  // extern "C"
