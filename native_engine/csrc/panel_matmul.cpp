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
// More rows re-read the panel from L2. While a panel's blocks of rows compute, they prefetch
// the next panel, each block every `blocks`-th of its cache lines, so the memory stream runs
// through all of them: when only the first block prefetched, a pass of 7-16 rows waited on
// memory in that block and left it idle in the others.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t PANEL = 16;  // output features per panel: two AVX2 vectors

// Rows x[0 .. MR - 1] (row stride K) times one panel; the 16 outputs of each row go to
// y[r * N + n0 ..]. `next`: the next panel's first cache line (one per k) this block
// prefetches (nullptr: none); SPREAD: then every `every`-th line after it, one each `every`
// k, else every line, one each k.
template <int MR, bool SPREAD>
inline void panel_block(const float* x, int64_t K, const float* panel, int64_t N, int64_t n0, float* y,
                        const float* next, int64_t every) {
  // Named accumulators, not an array: GCC kept an array's entries in memory and stored all of
  // them on every k (store-bound, at half the FMA rate).
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* w = panel;
  int64_t wait = 1;  // k until the next prefetch
  for (int64_t k = 0; k < K; ++k, w += PANEL) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    // One block (SPREAD false): a line per k, the loop as lean as it can be (the counter
    // cost 4-8% at one or two rows, where the loop waits on memory with little else to do).
    if constexpr (!SPREAD) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * PANEL), _MM_HINT_T0);
    } else if (next && --wait == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T0);
      next += every * PANEL;
      wait = every;
    }
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
      const int64_t n0 = p * PANEL, blocks = (M + 5) / 6;
      int64_t m = 0, block = 0;
      // block j prefetches the next panel's lines j, j + blocks, j + 2 * blocks, ...
      auto share = [&](int64_t j) { return next ? next + j * PANEL : nullptr; };
      if (blocks == 1) {  // up to 6 rows: one block streams the panel and prefetches all of the next
        switch (M) {
          case 6: panel_block<6, false>(xp, K, panel, N, n0, yp, next, 1); break;
          case 5: panel_block<5, false>(xp, K, panel, N, n0, yp, next, 1); break;
          case 4: panel_block<4, false>(xp, K, panel, N, n0, yp, next, 1); break;
          case 3: panel_block<3, false>(xp, K, panel, N, n0, yp, next, 1); break;
          case 2: panel_block<2, false>(xp, K, panel, N, n0, yp, next, 1); break;
          case 1: panel_block<1, false>(xp, K, panel, N, n0, yp, next, 1); break;
          default: break;
        }
        continue;
      }
      for (; m + 6 <= M; m += 6, ++block)
        panel_block<6, true>(xp + m * K, K, panel, N, n0, yp + m * N, share(block), blocks);
      const float* xm = xp + m * K;
      float* ym = yp + m * N;
      const float* pf = share(block);
      switch (M - m) {
        case 5: panel_block<5, true>(xm, K, panel, N, n0, ym, pf, blocks); break;
        case 4: panel_block<4, true>(xm, K, panel, N, n0, ym, pf, blocks); break;
        case 3: panel_block<3, true>(xm, K, panel, N, n0, ym, pf, blocks); break;
        case 2: panel_block<2, true>(xm, K, panel, N, n0, ym, pf, blocks); break;
        case 1: panel_block<1, true>(xm, K, panel, N, n0, ym, pf, blocks); break;
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
