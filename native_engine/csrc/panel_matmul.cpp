// y = x W^T for a few rows x [M, K] and a float32 weight W [N, K] held in panels of 16 output
// features, [N / 16, K, 16] (panel p, row k = W[16p .. 16p + 15, k]), for x86 CPUs with AVX2 and
// FMA: torch.ops.adaspec.panel_matmul, built at run time by native_engine/cpu_kernels.py.
//
// Why: a decode step of 1-16 sequences must stream every weight from memory once, with little
// arithmetic per byte. On 2 AMD EPYC (Zen 2) cores oneDNN's prepacked matmul streamed
// SmolLM2's weights at 16 GB/s for one row and took 70 ms for 16 rows, where this loop takes
// 23 and 53 ms (docs/native-engine.md, "The panel matmul"). Each panel is one contiguous
// stream; for a block of up to 6 rows of x the 16 outputs of every row stay in 12 AVX2
// registers while the panel streams past (two vector loads and one broadcast per row and k).
// More rows re-read the panel from L2. The first block of rows prefetches the next panel,
// so the memory stream runs while the other blocks compute.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t PANEL = 16;  // output features per panel: two AVX2 vectors

// Rows x[0 .. MR - 1] (row stride K) times one panel; the 16 outputs of each row go to
// y[r * N + n0 ..]. `next`: a panel to prefetch, one cache line per k (nullptr: none).
template <int MR>
inline void panel_block(const float* x, int64_t K, const float* panel, int64_t N, int64_t n0, float* y,
                        const float* next) {
  // Named accumulators, not an array: GCC kept an array's entries in memory and stored all of
  // them on every k (store-bound, at half the FMA rate).
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* w = panel;
  for (int64_t k = 0; k < K; ++k, w += PANEL) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * PANEL), _MM_HINT_T0);
#define ADASPEC_ROW(r)                                      \
    if constexpr (MR > r) {                                 \
      const __m256 b = _mm256_broadcast_ss(x + r * K + k);  \
      c##r##0 = _mm256_fmadd_ps(b, w0, c##r##0);            \
      c##r##1 = _mm256_fmadd_ps(b, w1, c##r##1);            \
    }
    ADASPEC_ROW(0) ADASPEC_ROW(1) ADASPEC_ROW(2) ADASPEC_ROW(3) ADASPEC_ROW(4) ADASPEC_ROW(5)
#undef ADASPEC_ROW
  }
#define ADASPEC_STORE(r)                                    \
  if constexpr (MR > r) {                                   \
    _mm256_storeu_ps(y + r * N + n0, c##r##0);              \
    _mm256_storeu_ps(y + r * N + n0 + 8, c##r##1);          \
  }
  ADASPEC_STORE(0) ADASPEC_STORE(1) ADASPEC_STORE(2) ADASPEC_STORE(3) ADASPEC_STORE(4) ADASPEC_STORE(5)
#undef ADASPEC_STORE
}

}  // namespace

torch::Tensor panel_matmul(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == PANEL && x.size(1) == w.size(1),
              "x [M, K], w [N / 16, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), panels = w.size(0), N = panels * PANEL;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * PANEL;
      const float* next = p + 1 < end ? panel + K * PANEL : nullptr;
      const int64_t n0 = p * PANEL;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6, next = nullptr) panel_block<6>(xp + m * K, K, panel, N, n0, yp + m * N, next);
      const float* xm = xp + m * K;
      float* ym = yp + m * N;
      switch (M - m) {
        case 5: panel_block<5>(xm, K, panel, N, n0, ym, next); break;
        case 4: panel_block<4>(xm, K, panel, N, n0, ym, next); break;
        case 3: panel_block<3>(xm, K, panel, N, n0, ym, next); break;
        case 2: panel_block<2>(xm, K, panel, N, n0, ym, next); break;
        case 1: panel_block<1>(xm, K, panel, N, n0, ym, next); break;
        default: break;
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(adaspec, m) {
  m.def("panel_matmul(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(adaspec, CPU, m) {
  m.impl("panel_matmul", &panel_matmul);
}
