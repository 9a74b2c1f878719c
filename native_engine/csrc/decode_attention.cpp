// Attention of one new token per sequence over its float32 KV cache (a decode step), for x86
// CPUs with AVX2 and FMA: torch.ops.adaspec.decode_attention, built at run time by
// native_engine/cpu_kernels.py (used by native_engine/decode_attention.py).
//
// Why not torch's scaled_dot_product_attention: for one query token its CPU flash kernel runs
// two small library GEMMs and a masked softmax per (sequence, KV head), and on 2 Zen 2 cores a
// batch-16 decode step's attention read the cache at about 7 GB/s against 17-20 GB/s for a
// plain pass over the same memory (docs/native-engine.md, "Decode attention"). Here each
// (sequence, KV head) reads its keys and values once, only up to the sequence's own length,
// with the query heads of its group held side by side.
//
// Layouts: q [B, Hkv, G, D] contiguous (G query heads share KV head h); k, v [B, Hkv, S, D]
// with D contiguous and rows of D (views of the cache); lengths [B] int64, keys per sequence
// (<= S). Output [B, Hkv, G, D].

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// exp(x) for x <= 0 (scores minus their maximum): x = n ln2 + r, |r| <= ln2 / 2, then
// 2^n * p(r) with Cephes' expf polynomial (about 1 ulp). Below -87 the result is clamped to
// exp(-87) ~ 1.6e-38, which no softmax sum notices.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// scores[j][s] = scale * q_j . k_s for the GB query heads q (rows of D) and keys 0..n-1.
// Two accumulators per head keep eight FMA chains in flight.
template <int GB>
void scores_of(const float* q, const float* k, int64_t n, int64_t D, float scale, float* scores, int64_t stride) {
  for (int64_t s = 0; s < n; ++s) {
    const float* key = k + s * D;
    __m256 acc[GB][2];
    for (int j = 0; j < GB; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m256 k0 = _mm256_loadu_ps(key + d), k1 = _mm256_loadu_ps(key + d + 8);
      for (int j = 0; j < GB; ++j) {
        acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d), k0, acc[j][0]);
        acc[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d + 8), k1, acc[j][1]);
      }
    }
    for (int j = 0; j < GB; ++j) scores[j * stride + s] = scale * horizontal_sum(_mm256_add_ps(acc[j][0], acc[j][1]));
  }
}

// out[j] = sum_s weights[j][s] v_s / sums[j]. The value rows are read once, in order (one
// stream the prefetcher follows); the GB output rows accumulate in place, in L1. Reading a
// cache line's worth of dimensions per pass instead (accumulators in registers, the rows
// read D / 16 times) was 20% slower at 160-320 keys.
template <int GB>
void weighted_values(const float* weights, int64_t stride, const float* sums, const float* v, int64_t n,
                     int64_t D, float* out) {
  std::fill(out, out + GB * D, 0.0f);
  for (int64_t s = 0; s < n; ++s) {
    const float* row = v + s * D;
    __m256 w[GB];
    for (int j = 0; j < GB; ++j) w[j] = _mm256_broadcast_ss(weights + j * stride + s);
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x = _mm256_loadu_ps(row + d);
      for (int j = 0; j < GB; ++j) {
        float* o = out + j * D + d;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(w[j], x, _mm256_loadu_ps(o)));
      }
    }
  }
  for (int j = 0; j < GB; ++j) {
    const __m256 inv = _mm256_set1_ps(1.0f / sums[j]);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + j * D + d, _mm256_mul_ps(_mm256_loadu_ps(out + j * D + d), inv));
  }
}

// exp(x) for x <= 0, exactly 0 where x is -inf (a masked score).
inline __m256 exp_or_zero(__m256 x) {
  const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm256_andnot_ps(masked, exp_nonpositive(x));
}

// Turns each row of scores into exp(score - max) in place, every key by the same vector code
// (the last few through a padded block), so a key's weight does not depend on how many keys
// the pass reads.
void exponentiate(float* scores, int64_t stride, int64_t rows, int64_t n) {
  for (int64_t j = 0; j < rows; ++j) {
    float* row = scores + j * stride;
    const __m256 top = _mm256_set1_ps(*std::max_element(row, row + n));
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) _mm256_storeu_ps(row + s, exp_or_zero(_mm256_sub_ps(_mm256_loadu_ps(row + s), top)));
    if (s < n) {
      alignas(32) float tail[8];
      std::fill(tail, tail + 8, -INFINITY);
      std::copy(row + s, row + n, tail);
      _mm256_store_ps(tail, exp_or_zero(_mm256_sub_ps(_mm256_load_ps(tail), top)));
      std::copy(tail, tail + (n - s), row + s);
    }
  }
}

// Each of the GB rows' sum of its n weights, added key by key in order. Masked keys weigh
// exactly 0 and add nothing, so a token's sum is the same in a decode step (its keys 0..n-1)
// and in a verify pass (more keys read, the others masked; or a tree's ancestors lying apart,
// which a decode step after the accepted path was compacted reads side by side): greedy
// output under speculation then equals `off`'s bit for bit. Summed in eight lanes by key
// position instead, with the last n % 8 keys added one by one, a decode step at n = 8m + 7
// keys and a verify pass reading one masked key more gave other bits (2026-12-05).
template <int GB>
void row_sums(const float* weights, int64_t stride, int64_t n, float* sums) {
  float total[GB] = {};
  for (int64_t s = 0; s < n; ++s)
    for (int j = 0; j < GB; ++j) total[j] += weights[j * stride + s];
  std::copy(total, total + GB, sums);
}

// The GB query heads q (rows of D) over keys 0..n-1; with `allowed` (nullptr: every key), a
// tree verify pass's mask row: only where allowed[s] (the row's prefix, then its ancestors
// among the tree's keys), masked scores (-inf) taking no part in the maximum and weighted exactly 0;
// a query with no allowed key gets zeros.
template <int GB>
void attend_group(const float* q, const float* k, const float* v, int64_t n, int64_t D, float scale,
                  const uint8_t* allowed, float* scores, int64_t stride, float* out) {
  if (allowed && std::find(allowed, allowed + n, uint8_t{1}) == allowed + n) {
    std::fill(out, out + GB * D, 0.0f);
    return;
  }
  float sums[GB];
  scores_of<GB>(q, k, n, D, scale, scores, stride);
  if (allowed) {
    for (int j = 0; j < GB; ++j)
      for (int64_t s = 0; s < n; ++s)
        if (!allowed[s]) scores[j * stride + s] = -INFINITY;
  }
  exponentiate(scores, stride, GB, n);
  row_sums<GB>(scores, stride, n, sums);
  weighted_values<GB>(scores, stride, sums, v, n, D, out);
}

void attend(const float* q, const float* k, const float* v, int64_t n, int64_t G, int64_t D, float scale,
            const uint8_t* allowed, float* scores, int64_t stride, float* out) {
  for (int64_t g = 0; g < G; g += 4) {  // query heads in groups of up to four
    const float* qg = q + g * D;
    float* og = out + g * D;
    switch (std::min<int64_t>(4, G - g)) {
      case 4: attend_group<4>(qg, k, v, n, D, scale, allowed, scores, stride, og); break;
      case 3: attend_group<3>(qg, k, v, n, D, scale, allowed, scores, stride, og); break;
      case 2: attend_group<2>(qg, k, v, n, D, scale, allowed, scores, stride, og); break;
      default: attend_group<1>(qg, k, v, n, D, scale, allowed, scores, stride, og); break;
    }
  }
}

// Where one pass's pieces live. The query of (sequence b, token t, KV head h) - the G query
// heads of the group side by side, rows of D - is at q + b * q_b + t * q_t + h * q_h, its
// output at out + b * o_b + t * o_t + h * o_h; the keys and values of (b, h) at
// k + b * k_b + h * k_h and v + b * v_b + h * v_h, key s D floats after key s - 1. Sequence b
// reads its first counts[b] keys; with `allowed` (a tree mask, [B, T, width] bytes), query
// (b, t) only those where allowed[(b * T + t) * width + s]. So each op below hands the loops
// views as they are, without copying its queries into the kernel's order or its output out of it.
struct Pass {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  int64_t q_b, q_t, q_h, o_b, o_t, o_h, k_b, k_h, v_b, v_h;
  int64_t B, T, Hkv, G, D;
  const int64_t* counts;
  const uint8_t* allowed;
  int64_t width;
  float scale;
};

// With a mask, a query starts at the first key it may attend: the keys before it would score
// -inf. A verify pass's pad tokens (a row's places after its own tree: the trees of one pass
// are uneven under per-request budgets) see no key of their row's prefix
// (native_engine.tree.attention_mask), and their outputs are dropped: they get zeros here
// without being attended.
//
// The work is split among the threads by cost: the first query of a (sequence, KV head) pair
// reads the pair's keys and values from memory, the others find them in the core's cache, so
// the first costs about keys x (1 + READ_COST) and the others keys each. Split as
// (b, h, t) in order instead, one long chain among rows without drafts left one thread the
// chain (its row read once) and the other every other row read from memory: 2026-12-06,
// Xeon, batch 16, 500 keys a row, cache rows cycled through 30 layers: 1.92 ms a layer for a
// chain of 16 nodes against 1.22 for the same 16 nodes one per row; measured there, a pair's
// first query cost about 39 us and each further one 12.
constexpr int64_t READ_COST = 2;

void run(const Pass& p) {
  const int64_t most = p.B ? *std::max_element(p.counts, p.counts + p.B) : 0;
  std::vector<int64_t> items;  // item = (b * Hkv + h) * T + t, the real queries, pair by pair
  std::vector<int64_t> starts;  // where each (b, h) pair's items begin in `items`
  items.reserve(p.B * p.Hkv * p.T);
  starts.reserve(p.B * p.Hkv + 1);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.Hkv; ++h) {
      starts.push_back(static_cast<int64_t>(items.size()));
      for (int64_t t = 0; t < p.T; ++t) {
        // Key 0 begins every real query's prefix (a decoding row holds at least its prompt).
        if (p.allowed && t > 0 && !p.allowed[(b * p.T + t) * p.width]) {
          float* out = p.out + b * p.o_b + t * p.o_t + h * p.o_h;
          std::fill(out, out + p.G * p.D, 0.0f);
          continue;
        }
        items.push_back((b * p.Hkv + h) * p.T + t);
      }
    }
  starts.push_back(static_cast<int64_t>(items.size()));
  // Each thread takes a run of items of about equal cost, in (b, h, t) order: neighbouring
  // pairs' keys lie side by side in the cache, and a thread streaming them in order read
  // faster than one dealt every other pair (1.34 against 1.22 ms a layer for one node per
  // row, as above); a pair may be split (batch 1: three pairs for two threads).
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  std::vector<double> cost(n_items);
  double total = 0.0;
  for (int64_t pair = 0; pair + 1 < static_cast<int64_t>(starts.size()); ++pair)
    for (int64_t i = starts[pair]; i < starts[pair + 1]; ++i) {
      cost[i] = static_cast<double>(p.counts[pair / p.Hkv]) * (i == starts[pair] ? 1 + READ_COST : 1);
      total += cost[i];
    }
  std::vector<int64_t> first_item(threads + 1, n_items);
  first_item[0] = 0;
  double before = 0.0;
  for (int64_t i = 0, th = 0; i < n_items; ++i) {
    const int64_t mine = std::min<int64_t>(threads - 1, static_cast<int64_t>((before + cost[i] / 2) * threads / total));
    while (th < mine) first_item[++th] = i;
    before += cost[i];
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(std::min<int64_t>(4, p.G) * most);
    for (int64_t i = first_item[begin]; i < first_item[end]; ++i) {
      const int64_t item = items[i];
      const int64_t t = item % p.T, h = (item / p.T) % p.Hkv, b = item / (p.T * p.Hkv);
      const uint8_t* allowed = p.allowed ? p.allowed + (b * p.T + t) * p.width : nullptr;
      int64_t first = allowed ? std::find(allowed, allowed + p.counts[b], uint8_t{1}) - allowed : 0;
      if (first == p.counts[b]) first = 0;  // no key at all: every score -inf, zeros out
      attend(p.q + b * p.q_b + t * p.q_t + h * p.q_h, p.k + b * p.k_b + h * p.k_h + first * p.D,
             p.v + b * p.v_b + h * p.v_h + first * p.D, p.counts[b] - first, p.G, p.D, p.scale,
             allowed ? allowed + first : nullptr, scores.data(), most, p.out + b * p.o_b + t * p.o_t + h * p.o_h);
    }
  });
}

// counts [B] int64, each in 1..limit (keys per sequence). Returns it contiguous.
torch::Tensor checked_counts(const torch::Tensor& counts, int64_t B, int64_t limit) {
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 1 && counts.size(0) == B, "keys per sequence: [B] int64");
  auto counts_c = counts.contiguous();
  const int64_t* n_of = counts_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(n_of[b] >= 1 && n_of[b] <= limit, "sequence ", b, ": ", n_of[b], " keys of ", limit);
  return counts_c;
}

// k, v [B, Hkv, S, D] float32 with rows of D contiguous (views of the cache).
void check_keys(const torch::Tensor& k, const torch::Tensor& v, int64_t B, int64_t Hkv, int64_t D) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(D % 16 == 0, "head dim must be a multiple of 16, got ", D);
  TORCH_CHECK(k.dim() == 4 && k.size(0) == B && k.size(1) == Hkv && k.size(3) == D && v.sizes() == k.sizes(),
              "k, v: [B, Hkv, S, D]");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D,
              "k, v: rows of D contiguous floats");
}

// allowed [B, T, width] bool, contiguous: a verify pass's mask.
const uint8_t* checked_mask(const torch::Tensor& allowed, int64_t B, int64_t T, int64_t width) {
  TORCH_CHECK(allowed.scalar_type() == at::kBool && allowed.is_contiguous() && allowed.dim() == 3 &&
              allowed.size(0) == B && allowed.size(1) == T && allowed.size(2) == width,
              "allowed: [B, T, ", width, "] bool, contiguous");
  return reinterpret_cast<const uint8_t*>(allowed.data_ptr<bool>());
}

}  // namespace

// A verify pass's attention (T tokens per sequence: a draft tree's root and nodes) over the
// float32 KV cache: q [B, Hkv, T, G, D] contiguous; k, v [B, Hkv, S, D] as for
// decode_attention; counts [B] int64, the keys each sequence's queries read (its prefix and
// its tree, <= S); allowed [B, T, S] bool contiguous, the pass's mask. torch's attention runs
// every sequence over all S keys under the mask (the longest sequence's length for each);
// here each reads its own `counts`. Output [B, Hkv, T, G, D].
torch::Tensor tree_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& counts, const torch::Tensor& allowed, double scale) {
  TORCH_CHECK(q.dim() == 5 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, Hkv, T, G, D] float32, contiguous");
  const int64_t B = q.size(0), Hkv = q.size(1), T = q.size(2), G = q.size(3), D = q.size(4);
  check_keys(k, v, B, Hkv, D);
  const int64_t S = k.size(2);
  const auto counts_c = checked_counts(counts, B, S);
  auto out = torch::empty_like(q);
  run({q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
       Hkv * T * G * D, G * D, T * G * D, Hkv * T * G * D, G * D, T * G * D, k.stride(0), k.stride(1), v.stride(0),
       v.stride(1), B, T, Hkv, G, D, counts_c.data_ptr<int64_t>(), checked_mask(allowed, B, T, S), S,
       static_cast<float>(scale)});
  return out;
}

// A decode step's attention: q [B, Hkv, G, D] contiguous; k, v [B, Hkv, S, D]; lengths [B]
// int64, keys per sequence (<= S). Output [B, Hkv, G, D].
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, Hkv, G, D] float32, contiguous");
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3);
  check_keys(k, v, B, Hkv, D);
  const auto lengths_c = checked_counts(lengths, B, k.size(2));
  auto out = torch::empty_like(q);
  run({q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
       Hkv * G * D, 0, G * D, Hkv * G * D, 0, G * D, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
       B, 1, Hkv, G, D, lengths_c.data_ptr<int64_t>(), nullptr, 0, static_cast<float>(scale)});
  return out;
}

// A pass's attention over the float32 KV cache, its own keys and values written to the cache
// first: what a layer of the native engine runs for a decode step (`counts`: each sequence's
// length, no `allowed`) or a verify pass (`allowed`: the tree mask [B, T, S], S the pass's key
// length; counts within it). One call per layer instead of the cache write, the views and the
// kernel call from Python: at batch 1 those cost 75 us a layer where the kernel took 10
// (docs/native-engine.md, "Decode attention").
// q [B, T, H, D] and k, v [B, T, Hkv, D] float32 (views of the pass's qkv projection, read in
// place where each head's D floats are contiguous); k_cache, v_cache [layers, rows, Hkv, max_len, D] contiguous: entry
// (b, t) goes to row row_start + b, position write_pos[b, t] (int64 [B, T]). Output [B, T, H * D].
torch::Tensor write_and_attend(const torch::Tensor& q_pass, const torch::Tensor& k_pass, const torch::Tensor& v_pass,
                               const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t layer,
                               int64_t row_start, const torch::Tensor& write_pos, const torch::Tensor& counts,
                               const std::optional<torch::Tensor>& allowed, double scale) {
  // A bfloat16 model's pass runs over a float32 cache (KVCache.allocate): its q, k and v are
  // widened (exactly: a bfloat16 is a float32's top half) and the output rounded back.
  const bool bf16 = q_pass.scalar_type() == at::kBFloat16;
  const auto widened = [&](const torch::Tensor& t) { return bf16 ? t.to(at::kFloat) : t; };
  const auto q_in = widened(q_pass), k_in = widened(k_pass), v_in = widened(v_pass);
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat, "q: [B, T, H, D] float32 or bfloat16");
  const int64_t B = q_in.size(0), T = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  // Other layouts (a compiled graph may hand over any) are copied into this one.
  const auto q = q_in.stride(3) == 1 && q_in.stride(2) == D ? q_in : q_in.contiguous();
  const auto k = k_in.dim() == 4 && k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const auto v = v_in.dim() == 4 && v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  TORCH_CHECK(D % 16 == 0, "head dim must be a multiple of 16, got ", D);
  TORCH_CHECK(k.dim() == 4 && k.size(0) == B && k.size(1) == T && k.size(3) == D && v.sizes() == k.sizes() &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "k, v: [B, T, Hkv, D] in q's dtype");
  const int64_t Hkv = k.size(2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, H, " query heads cannot share ", Hkv, " KV heads");
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.size(2) == Hkv &&
              k_cache.size(4) == D, "caches: [layers, rows, Hkv, max_len, D] float32, contiguous");
  const int64_t rows = k_cache.size(1), S = k_cache.size(3);
  TORCH_CHECK(layer >= 0 && layer < k_cache.size(0) && row_start >= 0 && row_start + B <= rows,
              "layer ", layer, ", rows ", row_start, "..", row_start + B, " outside the cache");
  TORCH_CHECK(write_pos.scalar_type() == at::kLong && write_pos.dim() == 2 && write_pos.size(0) == B && write_pos.size(1) == T,
              "write_pos: [B, T] int64");
  TORCH_CHECK(allowed || T == 1, "a pass without a tree mask takes one token per sequence, got ", T);
  const int64_t width = allowed ? allowed->size(-1) : S;
  TORCH_CHECK(width >= 1 && width <= S, "the pass reads ", width, " keys of ", S);
  const uint8_t* mask = allowed ? checked_mask(*allowed, B, T, width) : nullptr;
  const auto counts_c = checked_counts(counts, B, width);
  const auto pos_c = write_pos.contiguous();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>() + (layer * rows + row_start) * Hkv * S * D;
  float* vc = v_cache.data_ptr<float>() + (layer * rows + row_start) * Hkv * S * D;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pos[b * T + t];
      TORCH_CHECK(p >= 0 && p < S, "sequence ", b, ": write position ", p, " outside the cache (", S, ")");
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = ((b * Hkv + h) * S + p) * D;
        std::copy_n(kp + b * k.stride(0) + t * k.stride(1) + h * k.stride(2), D, kc + at);
        std::copy_n(vp + b * v.stride(0) + t * v.stride(1) + h * v.stride(2), D, vc + at);
      }
    }
  const int64_t G = H / Hkv;
  auto out = torch::empty({B, T, H * D}, q.options());
  run({q.data_ptr<float>(), kc, vc, out.data_ptr<float>(), q.stride(0), q.stride(1), G * D, T * H * D, H * D, G * D,
       Hkv * S * D, S * D, Hkv * S * D, S * D, B, T, Hkv, G, D, counts_c.data_ptr<int64_t>(), mask, width,
       static_cast<float>(scale)});
  return bf16 ? out.to(at::kBFloat16) : out;
}

// Operators (torch.ops.adaspec.*), so profilers and the dispatcher see them.
TORCH_LIBRARY_FRAGMENT(adaspec, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale) -> Tensor");
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor counts, Tensor allowed, float scale) -> Tensor");
  m.def("write_and_attend(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, int layer, int row_start, "
        "Tensor write_pos, Tensor counts, Tensor? allowed, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(adaspec, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("tree_attention", &tree_attention);
  m.impl("write_and_attend", &write_and_attend);
}
