// y = x W^T for a few rows x [M, K] and a weight W [N, K] held in panels of 16 output features,
// [N / 16, K, 16] (panel p, row k = W[16p .. 16p + 15, k]), for x86 CPUs with AVX2 and FMA:
// torch.ops.adaspec.panel_matmul (float32) and panel_matmul_bf16 (bfloat16 weights, x and y;
// float32 sums; on AMX, AVX512-BF16 or AVX2, whichever the CPU has, below), built at run time
// by native_engine/cpu_kernels.py.
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
//
// bfloat16: half the bytes to stream, the same loop. A bfloat16 is the top half of a float32,
// so widening needs no BF16 instructions (AVX2 suffices): a panel row's 16 values are stored
// interleaved, features 0 and 8, 1 and 9, ... in each 32-bit lane, so one 256-bit load, a shift
// left by 16 (features 0-7) and a mask of the top halves (features 8-15) give the two float32
// vectors. Accumulation is float32, as oneDNN's bfloat16 matmul; each output is rounded to
// bfloat16 once (round to nearest even), as torch rounds a bfloat16 matmul's result.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t PANEL = 16;  // output features per panel: two AVX2 vectors

// A panel row's 16 weights as two float32 vectors (features 0-7, 8-15).
inline void load_row(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}

// bfloat16, interleaved (lane i holds feature i in its low half and feature 8 + i in its high).
inline void load_row(const at::BFloat16* w, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline void store_row(float* y, __m256 c0, __m256 c1) {
  _mm256_storeu_ps(y, c0);
  _mm256_storeu_ps(y + 8, c1);
}

inline void store_row(at::BFloat16* y, __m256 c0, __m256 c1) {
  alignas(32) float out[PANEL];
  _mm256_store_ps(out, c0);
  _mm256_store_ps(out + 8, c1);
  for (int64_t i = 0; i < PANEL; ++i) y[i] = at::BFloat16(out[i]);  // round to nearest even
}

// Rows x[0 .. MR - 1] (row stride K) times one panel; the 16 outputs of each row go to
// y[r * N + n0 ..]. `next`: the next panel's first cache line (one per k) this block
// prefetches (nullptr: none); SPREAD: then every `every`-th line after it, one each `every`
// k, else every line, one each k.
template <int MR, bool SPREAD, typename W, typename Y>
inline void panel_block(const float* x, int64_t K, const W* panel, int64_t N, int64_t n0, Y* y,
                        const W* next, int64_t every) {
  // Named accumulators, not an array: GCC kept an array's entries in memory and stored all of
  // them on every k (store-bound, at half the FMA rate).
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const W* w = panel;
  int64_t wait = 1;  // k until the next prefetch
  for (int64_t k = 0; k < K; ++k, w += PANEL) {
    __m256 w0, w1;
    load_row(w, w0, w1);
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
  if constexpr (MR > r) store_row(y + r * N + n0, c##r##0, c##r##1);
  ADASPEC_STORE(0) ADASPEC_STORE(1) ADASPEC_STORE(2) ADASPEC_STORE(3) ADASPEC_STORE(4) ADASPEC_STORE(5)
#undef ADASPEC_STORE
}

// The panels of w [N / 16, K, 16] times float32 rows xp [M, K] into yp [M, N], split over torch's threads.
template <typename W, typename Y>
void panels_times_rows(const float* xp, const W* wp, Y* yp, int64_t M, int64_t K, int64_t panels) {
  const int64_t N = panels * PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const W* panel = wp + p * K * PANEL;
      const W* next = p + 1 < end ? panel + K * PANEL : nullptr;
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
      Y* ym = yp + m * N;
      const W* pf = share(block);
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
}

// AVX512-BF16, where the CPU has it (vdpbf16ps: 16 lanes, each adding two bfloat16 products
// into a float32 sum): two k per instruction, and a block of up to 16 rows in registers, one
// instruction per row and pair of k; the FMA loop above is bound by its FMAs from about 4
// rows. Its panel rows come in pairs, [N / 16, K / 2, 16, 2] (features in order, each
// feature's weights for k and k + 1 side by side: one cache line per pair), and x's pairs are
// read as they lie in a bfloat16 row. Other sums than the FMA loop's (the instruction's own
// order, subnormals flushed): a CPU takes one of the two kernels for every pass.
#define ADASPEC_BF16_DOT __attribute__((target("avx512f,avx512bf16")))
constexpr int64_t ROWS_DOT = 16;

bool has_bf16_dot() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return yes;
}

// The layout panel_matmul_bf16 reads on this CPU for K inputs: pairs (above) or interleaved.
bool pairs_layout(int64_t K) { return has_bf16_dot() && K % 2 == 0; }

template <int MR>
ADASPEC_BF16_DOT inline void pair_block(const at::BFloat16* x, int64_t K, const at::BFloat16* panel, int64_t N,
                                        int64_t n0, at::BFloat16* y, const at::BFloat16* next, int64_t every) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
         c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
  const at::BFloat16* w = panel;
  int64_t wait = 1;  // pairs until the next prefetch
  for (int64_t k = 0; k < K; k += 2, w += 2 * PANEL) {
    const __m512bh wk = (__m512bh)_mm512_loadu_si512(w);
    if (next && --wait == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T0);
      next += every * 2 * PANEL;
      wait = every;
    }
#define ADASPEC_PAIR(r)                                                       \
    if constexpr (MR > r) {                                                   \
      int32_t xr;                                                             \
      std::memcpy(&xr, x + r * K + k, sizeof xr);                             \
      c##r = _mm512_dpbf16_ps(c##r, (__m512bh)_mm512_set1_epi32(xr), wk);     \
    }
    ADASPEC_PAIR(0) ADASPEC_PAIR(1) ADASPEC_PAIR(2) ADASPEC_PAIR(3) ADASPEC_PAIR(4) ADASPEC_PAIR(5)
    ADASPEC_PAIR(6) ADASPEC_PAIR(7) ADASPEC_PAIR(8) ADASPEC_PAIR(9) ADASPEC_PAIR(10) ADASPEC_PAIR(11)
    ADASPEC_PAIR(12) ADASPEC_PAIR(13) ADASPEC_PAIR(14) ADASPEC_PAIR(15)
#undef ADASPEC_PAIR
  }
  alignas(64) float out[PANEL];
#define ADASPEC_PAIR_STORE(r)                                                                    \
  if constexpr (MR > r) {                                                                        \
    _mm512_store_ps(out, c##r);                                                                  \
    for (int64_t i = 0; i < PANEL; ++i) y[r * N + n0 + i] = at::BFloat16(out[i]);               \
  }
  ADASPEC_PAIR_STORE(0) ADASPEC_PAIR_STORE(1) ADASPEC_PAIR_STORE(2) ADASPEC_PAIR_STORE(3) ADASPEC_PAIR_STORE(4)
  ADASPEC_PAIR_STORE(5) ADASPEC_PAIR_STORE(6) ADASPEC_PAIR_STORE(7) ADASPEC_PAIR_STORE(8) ADASPEC_PAIR_STORE(9)
  ADASPEC_PAIR_STORE(10) ADASPEC_PAIR_STORE(11) ADASPEC_PAIR_STORE(12) ADASPEC_PAIR_STORE(13)
  ADASPEC_PAIR_STORE(14) ADASPEC_PAIR_STORE(15)
#undef ADASPEC_PAIR_STORE
}

// One panel times the rows of x [M, K] into y, in as few blocks as hold ROWS_DOT rows each,
// the rows shared evenly among them, block j prefetching the next panel's lines j, j + blocks,
// ... (as panels_times_rows). Evenly: a block's rows are independent sums, and a block of one
// or two rows waits on its few sums' latency (about 6 cycles per pair of k) where 8 or more
// keep the unit busy; split 16 + 1, a batch-16 pass with one draft node took its matmuls 43%
// longer than one without (8.1 -> 11.6 ms, 2 Zen 4 cores), for a token more. Each row sums its
// k in the same order whatever block it is in: the same bits however the rows are split.
ADASPEC_BF16_DOT void panel_pairs(const at::BFloat16* x, const at::BFloat16* panel, const at::BFloat16* next,
                                  at::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  const int64_t blocks = (M + ROWS_DOT - 1) / ROWS_DOT;
  const int64_t least = M / blocks, more = M % blocks;  // the first `more` blocks take a row more
  for (int64_t m = 0, block = 0; m < M; ++block) {
    const int64_t rows = least + (block < more ? 1 : 0);
    const at::BFloat16* xm = x + m * K;
    at::BFloat16* ym = y + m * N;
    m += rows;
    const at::BFloat16* pf = next ? next + block * 2 * PANEL : nullptr;
    switch (rows) {
#define ADASPEC_CASE(r) case r: pair_block<r>(xm, K, panel, N, n0, ym, pf, blocks); break;
      ADASPEC_CASE(1) ADASPEC_CASE(2) ADASPEC_CASE(3) ADASPEC_CASE(4) ADASPEC_CASE(5) ADASPEC_CASE(6)
      ADASPEC_CASE(7) ADASPEC_CASE(8) ADASPEC_CASE(9) ADASPEC_CASE(10) ADASPEC_CASE(11) ADASPEC_CASE(12)
      ADASPEC_CASE(13) ADASPEC_CASE(14) ADASPEC_CASE(15) ADASPEC_CASE(16)
#undef ADASPEC_CASE
      default: break;
    }
  }
}

// AMX (Intel's tile unit, where the CPU and the kernel allow it): the same pairs layout is
// what a TDPBF16PS B tile reads, 16 k-pairs of a panel (1 KB contiguous) at a time, against up
// to 16 rows of x in an A tile, into 16 x 16 float32 sums in a C tile. One instruction does a
// block of rows' products for 32 k, so 16 rows cost hardly more than one (the dot-product loop
// above is bound by its instructions from about 8 rows, where oneDNN's AMX kernels were 3x
// faster). Weights whose K is not a multiple of 32 keep the dot-product loop (per weight, so
// every pass of that weight takes the same one).
#define ADASPEC_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))
constexpr int64_t AMX_K = 32;  // bf16 per A-tile row: 16 k-pairs

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool has_amx() {
  static const bool yes = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return yes;
}

bool amx_layout(int64_t K) { return pairs_layout(K) && K % AMX_K == 0 && has_amx(); }

// 16 float32 sums rounded to bfloat16 as at::BFloat16 rounds them (to nearest, ties to even;
// the sums are finite), one vector at a time instead of element by element.
ADASPEC_AMX inline void store_bf16(const float* sums, at::BFloat16* y) {
  const __m512i u = _mm512_castps_si512(_mm512_load_ps(sums));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(rounded));
}

// Rows x [M, K] (M <= 16 * NB) times panels p0..p1 of w into y, in NB blocks of up to 16 rows
// that share each loaded B tile: a verify pass of 17-48 rows streams every weight once, not
// once per 16 rows (a batch-16 step's matmuls took 13 ms at 16 rows, 20 ms at 32 that way;
// 17 ms now, docs/native-engine.md).
// Tiles: 0..NB-1 = A (x, a block each), 3 = B (panel), 4..3+NB = C. Each C tile sums its k
// in the same order as a block run alone: the same bits whatever rows share the pass.
template <int NB>
ADASPEC_AMX void panels_amx(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t M, int64_t K,
                            int64_t N, int64_t p0, int64_t p1) {
  TileConfig cfg;
  int64_t rows[NB];
  for (int j = 0; j < NB; ++j) {
    rows[j] = std::min<int64_t>(16, M - 16 * j);
    cfg.rows[j] = static_cast<uint8_t>(rows[j]);
    cfg.colsb[j] = AMX_K * 2;
    cfg.rows[4 + j] = static_cast<uint8_t>(rows[j]);
    cfg.colsb[4 + j] = PANEL * 4;
  }
  cfg.rows[3] = AMX_K / 2;
  cfg.colsb[3] = PANEL * 4;
  _tile_loadconfig(&cfg);
  alignas(64) float out[NB][16 * PANEL];
  for (int64_t p = p0; p < p1; ++p) {
    const at::BFloat16* panel = w + p * K * PANEL;
    _tile_zero(4);
    if constexpr (NB > 1) _tile_zero(5);
    if constexpr (NB > 2) _tile_zero(6);
    for (int64_t k = 0; k < K; k += AMX_K) {
      _tile_loadd(3, panel + k * PANEL, PANEL * 4);
      _tile_loadd(0, x + k, K * 2);
      _tile_dpbf16ps(4, 0, 3);
      if constexpr (NB > 1) {
        _tile_loadd(1, x + 16 * K + k, K * 2);
        _tile_dpbf16ps(5, 1, 3);
      }
      if constexpr (NB > 2) {
        _tile_loadd(2, x + 32 * K + k, K * 2);
        _tile_dpbf16ps(6, 2, 3);
      }
    }
    _tile_stored(4, out[0], PANEL * 4);
    if constexpr (NB > 1) _tile_stored(5, out[1], PANEL * 4);
    if constexpr (NB > 2) _tile_stored(6, out[2], PANEL * 4);
    for (int j = 0; j < NB; ++j)
      for (int64_t r = 0; r < rows[j]; ++r)
        store_bf16(out[j] + r * PANEL, y + (16 * j + r) * N + p * PANEL);
  }
  _tile_release();
}
constexpr int64_t AMX_ROWS = 48;  // rows per weight pass: three A tiles, three C tiles, one B

void check_shapes(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == PANEL && x.size(1) == w.size(1),
              "x [M, K], w [N / 16, K, 16]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
}

}  // namespace

torch::Tensor panel_matmul(const torch::Tensor& x, const torch::Tensor& w) {
  check_shapes(x, w);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  auto y = torch::empty({x.size(0), w.size(0) * PANEL}, x.options());
  panels_times_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), w.size(0));
  return y;
}

// w: bfloat16 panels in the layout panel_pack_bf16 gives on this CPU; x bfloat16, y bfloat16.
torch::Tensor panel_matmul_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  check_shapes(x, w);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bfloat16 only");
  const int64_t M = x.size(0), K = x.size(1), panels = w.size(0);
  auto y = torch::empty({M, panels * PANEL}, x.options());
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  if (amx_layout(K)) {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = 0; m < M; m += AMX_ROWS) {
        const int64_t rows = std::min<int64_t>(AMX_ROWS, M - m);
        const at::BFloat16* xm = xp + m * K;
        at::BFloat16* ym = yp + m * panels * PANEL;
        if (rows > 32) panels_amx<3>(xm, wp, ym, rows, K, panels * PANEL, begin, end);
        else if (rows > 16) panels_amx<2>(xm, wp, ym, rows, K, panels * PANEL, begin, end);
        else panels_amx<1>(xm, wp, ym, rows, K, panels * PANEL, begin, end);
      }
    });
    return y;
  }
  if (pairs_layout(K)) {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        panel_pairs(xp, wp + p * K * PANEL, p + 1 < end ? wp + (p + 1) * K * PANEL : nullptr, yp, M, K,
                    panels * PANEL, p * PANEL);
    });
    return y;
  }
  const auto xf = x.to(at::kFloat);  // the rows are read K times per panel block: widen them once
  panels_times_rows(xf.data_ptr<float>(), wp, yp, M, K, panels);
  return y;
}

// A bfloat16 weight [N, K] (N a multiple of 16) in the panels panel_matmul_bf16 reads on this
// CPU: pairs [N / 16, K / 2, 16, 2] for the AMX and AVX512-BF16 loops, else each panel row's 16
// interleaved (features 0, 8, 1, 9, ...) for the AVX2 one; shaped [N / 16, K, 16] either way.
torch::Tensor panel_pack_bf16(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % PANEL == 0 && w.scalar_type() == at::kBFloat16,
              "w: [N, K] bfloat16, N a multiple of 16");
  const int64_t N = w.size(0), K = w.size(1);
  const auto c = w.contiguous();
  if (pairs_layout(K)) return c.view({N / PANEL, PANEL, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / PANEL, K, PANEL});
  return c.view({N / PANEL, 2, PANEL / 2, K}).permute({0, 3, 2, 1}).contiguous().view({N / PANEL, K, PANEL});
}

TORCH_LIBRARY_FRAGMENT(adaspec, m) {
  m.def("panel_matmul(Tensor x, Tensor w) -> Tensor");
  m.def("panel_matmul_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("panel_pack_bf16(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(adaspec, CPU, m) {
  m.impl("panel_matmul", &panel_matmul);
  m.impl("panel_matmul_bf16", &panel_matmul_bf16);
  m.impl("panel_pack_bf16", &panel_pack_bf16);
}
