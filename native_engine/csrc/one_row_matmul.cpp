// y = x W^T for a few rows x [M, K] and a float32 weight W [N, K] ([out, in], row-major), for
// x86 CPUs with AVX2 and FMA: torch.ops.adaspec.one_row_matmul, built at run time by
// native_engine/cpu_kernels.py.
//
// Why: a batch-1 decode step is a string of matrix-vector products that must stream every
// weight from memory once. On 2 AMD EPYC (Zen 2) cores oneDNN's prepacked matmul streamed
// SmolLM2's layer weights at 16 GB/s for one row, where this loop reads them at 25-26 GB/s
// (docs/native-engine.md, "The one-row matmul"). Four weight rows at a time, each a
// sequential stream, share every load of x; for M > 1 rows the block of four weight rows is
// read from memory once and from L1 for the other rows.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

}  // namespace

torch::Tensor one_row_matmul(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 8 == 0, "in features must be a multiple of 8, got ", K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + 3) / 4;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * 4, rows = std::min<int64_t>(4, N - n0);
      const float* w0 = wp + n0 * K;
      // A short last block repeats its first row: same reads, results not stored.
      const float* w1 = rows > 1 ? w0 + K : w0;
      const float* w2 = rows > 2 ? w0 + 2 * K : w0;
      const float* w3 = rows > 3 ? w0 + 3 * K : w0;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xp + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
          const __m256 xv = _mm256_loadu_ps(xm + k);
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
          a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
          a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
        }
        float* ym = yp + m * N + n0;
        const float sums[4] = {horizontal_sum(a0), horizontal_sum(a1), horizontal_sum(a2), horizontal_sum(a3)};
        for (int64_t r = 0; r < rows; ++r) ym[r] = sums[r];
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(adaspec, m) {
  m.def("one_row_matmul(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(adaspec, CPU, m) {
  m.impl("one_row_matmul", &one_row_matmul);
}
