// megarl._keyed_gumbel: the Gumbel-max token of each row of a CPU sampler, fused in one pass.
//
// The torch reference is megarl/engine/sampler.py (`sample_keyed`, `_finish`, `_gumbel`) and
// megarl/engine/detmath.py (`det_log`); this file computes the same bits. In torch the noise of
// one (row, token) is ~60 separate elementwise kernels over int64/float32 tensors, each written to
// memory: ~3.5 ms per row of a 49k vocabulary on the CPUs here, as much as a SmolLM2 decode step
// at batch 1. Here it is ~60 operations in registers, and only for the tokens that can still win.
// Two paths compute the same bits: a scalar one (any CPU), and where the CPU has AVX-512
// (checked at run time) one that hashes and scores 16 tokens per instruction; `vector=False`
// selects the scalar one (the tests run both).
//
// Why the result is bit for bit the torch one:
// - The hash is 32-bit integer arithmetic (murmur3's last round and finaliser), exact anywhere.
// - The noise is a function of the hash's top 23 bits only; `gumbel_of` repeats `_gumbel`'s float32
//   operations one by one (u = idx * 2**-23 + 2**-24 is exact; det_log is the musl logf sequence
//   of detmath.py). Every operation is an IEEE-754 float32 op, correctly rounded; the build passes
//   -ffp-contract=off so that no multiply-add is fused, and x86-64 evaluates float in float
//   (FLT_EVAL_METHOD 0). The AVX-512 twin `gumbel16` is the same sequence lane by lane.
//   tests/engine/test_sample_keyed.py compares all 2**23 values of both paths with torch's.
// - Scores are `s + g` in the sampler's dtype (float or double, g widened exactly), as torch adds
//   them; the argmax takes the first maximum, as torch.argmax does.
// - Pruning: fl(s_v + g_v) <= fl(s_v + hi) for every noise value (hi bounds them all; rounding is
//   monotone). The row's 16 highest scores are scored first (sampler.PROBE); a token whose
//   fl(s_v + hi) is below the best score so far scores strictly below the final maximum and is
//   skipped without hashing; one whose fl(s_v + b) is, with b the bound of its hash's bucket
//   (kNoiseBounds), is skipped after the hash, without the logarithms.
// A row with NaN gives -1: the caller takes its torch path (torch's argmax semantics for NaN are
// not repeated here).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__)
// GCC 12's AVX-512 header builds some intrinsics from _mm512_undefined_*(), which it then reports as
// (maybe) uninitialized (a false positive in the header, not in this file).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace py = pybind11;

namespace {

constexpr uint32_t kC1 = 0xCC9E2D51u, kC2 = 0x1B873593u, kF1 = 0x85EBCA6Bu, kF2 = 0xC2B2AE35u,
                   kN = 0xE6546B64u;

inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// sampler._absorb: one murmur3 body round folding the 32-bit word k into h.
inline uint32_t absorb(uint32_t h, uint32_t k) {
  k = rotl32(k * kC1, 15) * kC2;
  h = rotl32(h ^ k, 13);
  return h * 5u + kN;
}

// sampler._finish: the token word's body round and murmur3's finaliser (message length 32 bytes).
inline uint32_t finish(uint32_t h, uint32_t token) {
  uint32_t k = rotl32(token * kC1, 15) * kC2;
  h = rotl32(h ^ k, 13);
  h = h * 5u + kN;
  h ^= 32u;
  h ^= h >> 16;
  h *= kF1;
  h ^= h >> 13;
  h *= kF2;
  return h ^ (h >> 16);
}

inline float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// detmath.det_log for a positive normal float32 (the only inputs the noise produces: u in
// [2**-24, 1 - 2**-24] and -log(u) in [5.9e-8, 16.7]).
inline float det_log_normal(float x) {
  constexpr float LG1 = 0.666666626930236816406250f, LG2 = 0.400009721517562866210938f,
                  LG3 = 0.284987866878509521484375f, LG4 = 0.242790788412094116210938f,
                  LN2_HI = 0.693138122558593750f, LN2_LO = 9.05800061445916071534e-06f;
  const int32_t ix = static_cast<int32_t>(to_bits(x)) + (0x3F800000 - 0x3F3504F3);
  const int32_t k = (ix >> 23) - 127;
  const float m = from_bits((static_cast<uint32_t>(ix) & 0x007FFFFFu) + 0x3F3504F3u);
  const float f = m - 1.0f;
  const float s = f / (f + 2.0f);
  const float z = s * s;
  const float w = z * z;
  const float t1 = w * ((w * LG4) + LG2);
  const float t2 = z * ((w * LG3) + LG1);
  const float r = t2 + t1;
  const float hfsq = (f * 0.5f) * f;
  const float dk = static_cast<float>(k);
  return ((((s * (hfsq + r)) + (dk * LN2_LO)) - hfsq) + f) + (dk * LN2_HI);
}

// sampler._gumbel of a hash whose top 23 bits are idx.
inline float gumbel_of(uint32_t idx) {
  const float u = static_cast<float>(idx) * 1.1920928955078125e-07f + 5.9604644775390625e-08f;
  return -det_log_normal(-det_log_normal(u));
}

// A bound on the noise of a hash prefix idx that costs no logarithm. The noise grows with idx
// (u nears 1 as d = 2**23 - 1 - idx shrinks; non-decreasing over all 2**23 values, which
// tests/engine/test_keyed_gumbel.py checks). bucket(idx) is d's bit length (0 for d = 0, k for d
// in [2**(k-1), 2**k)), and the bound of bucket k is the noise of its largest idx, i.e. the
// largest noise in it. Each bucket spans ~ln 2 of noise, so a token whose score plus its bucket's
// bound stays below the best score cannot win (the same monotone-rounding argument as for hi) and
// skips both logarithms; on flat rows that is nearly every token.
inline int bucket_of(uint32_t idx) {
  const uint32_t d = 0x7FFFFFu - idx;
  return d ? 32 - __builtin_clz(d) : 0;
}

struct NoiseBounds {
  float by_bucket[32];  // buckets 24..31 do not occur (+inf)
  NoiseBounds() {
    for (int k = 0; k < 32; ++k)
      by_bucket[k] = k > 23 ? INFINITY : gumbel_of(0x7FFFFFu - (k ? 1u << (k - 1) : 0u));
  }
};
const NoiseBounds kNoiseBounds;

// sampler._row_state: the murmur state after the 7 per-row key words (seed, step, uid, sample
// index, position; seed already reduced to 64 bits, step to 32 by the caller).
inline uint32_t row_state(uint64_t seed, uint32_t step, int64_t uid, int64_t sample_idx, int64_t position) {
  const uint64_t u = static_cast<uint64_t>(uid);
  uint32_t h = 0;
  for (uint32_t w : {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), step, static_cast<uint32_t>(u),
                     static_cast<uint32_t>(u >> 32), static_cast<uint32_t>(sample_idx), static_cast<uint32_t>(position)})
    h = absorb(h, w);
  return h;
}

constexpr int kProbe = 16;  // sampler.PROBE: highest logits scored first, for a tight bound

// Token j joins the row's kProbe highest scores top[0..n_top) (kept sorted, ties: lower id first)
// if it ranks among them.
template <typename T>
inline void probe_insert(const T* s, int64_t j, int64_t* top, int& n_top) {
  if (n_top == kProbe && !(s[j] > s[top[kProbe - 1]])) return;
  int i = n_top < kProbe ? n_top++ : kProbe - 1;
  while (i > 0 && s[j] > s[top[i - 1]]) {
    top[i] = top[i - 1];
    --i;
  }
  top[i] = j;
}

template <typename T>
inline T score_of(const T* s, uint32_t h, int64_t j) {
  return s[j] + static_cast<T>(gumbel_of(finish(h, static_cast<uint32_t>(j)) >> 9));
}

// The best exact score of the probed tokens; arg gets its token (the lowest id on ties).
template <typename T>
inline T probe_best(const T* s, const int64_t* top, int n_top, uint32_t h, int64_t& arg) {
  arg = top[0];
  T best = score_of(s, h, arg);
  for (int i = 1; i < n_top; ++i) {
    const T sc = score_of(s, h, top[i]);
    if (sc > best || (sc == best && top[i] < arg)) best = sc, arg = top[i];
  }
  return best;
}

// The Gumbel-max token of one row of scores s[0..v) under the key state h; -1 if s has a NaN.
template <typename T>
int64_t row_argmax(const T* s, int64_t v, uint32_t h, T hi) {
  int64_t top[kProbe];
  int n_top = 0;
  for (int64_t j = 0; j < v; ++j) {
    if (s[j] != s[j]) return -1;
    probe_insert(s, j, top, n_top);
  }
  int64_t arg;
  T best = probe_best(s, top, n_top, h, arg);
  // Every other token that can still reach the best score so far (the probed ones are scored
  // again: same score, and the tie rule keeps the lowest id).
  for (int64_t j = 0; j < v; ++j) {
    if (!(s[j] + hi >= best)) continue;
    const uint32_t idx = finish(h, static_cast<uint32_t>(j)) >> 9;
    if (!(s[j] + static_cast<T>(kNoiseBounds.by_bucket[bucket_of(idx)]) >= best)) continue;
    const T sc = s[j] + static_cast<T>(gumbel_of(idx));
    if (sc > best || (sc == best && j < arg)) best = sc, arg = j;
  }
  return arg;
}

#if defined(__x86_64__)
// ---------------------------------------------------------------------------------------------
// The same row, 16 tokens per AVX-512 register (chosen at run time, see has_avx512). Every float
// operation is the scalar path's, in the same order, as a separate _mm512_{add,sub,mul,div}_ps
// (correctly rounded per lane, like the scalar op; no fmadd anywhere, and -ffp-contract=off keeps
// the compiler from fusing them); the hash is the same 32-bit integer arithmetic per lane. Ties
// are settled by id explicitly, so the lanes' scores can be compared as a block.
#define KG_AVX512 __attribute__((target("avx512f")))

KG_AVX512 inline __m512i set1u(uint32_t x) { return _mm512_set1_epi32(static_cast<int32_t>(x)); }

// finish() on 16 token ids.
KG_AVX512 inline __m512i finish16(__m512i h, __m512i token) {
  __m512i k = _mm512_mullo_epi32(_mm512_rol_epi32(_mm512_mullo_epi32(token, set1u(kC1)), 15), set1u(kC2));
  __m512i x = _mm512_rol_epi32(_mm512_xor_si512(h, k), 13);
  x = _mm512_add_epi32(_mm512_mullo_epi32(x, set1u(5u)), set1u(kN));
  x = _mm512_xor_si512(x, set1u(32u));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, set1u(kF1));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, set1u(kF2));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

KG_AVX512 inline __m512 neg16(__m512 x) {  // the sign bit flipped, as unary minus does
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), set1u(0x80000000u)));
}

// det_log_normal() on 16 lanes, op for op.
KG_AVX512 inline __m512 det_log16(__m512 x) {
  const __m512i ix = _mm512_add_epi32(_mm512_castps_si512(x), set1u(0x3F800000u - 0x3F3504F3u));
  const __m512i k = _mm512_sub_epi32(_mm512_srai_epi32(ix, 23), set1u(127u));
  const __m512 m = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_and_si512(ix, set1u(0x007FFFFFu)), set1u(0x3F3504F3u)));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  const __m512 s = _mm512_div_ps(f, _mm512_add_ps(f, _mm512_set1_ps(2.0f)));
  const __m512 z = _mm512_mul_ps(s, s);
  const __m512 w = _mm512_mul_ps(z, z);
  const __m512 t1 = _mm512_mul_ps(w, _mm512_add_ps(_mm512_mul_ps(w, _mm512_set1_ps(0.242790788412094116210938f)),
                                                   _mm512_set1_ps(0.400009721517562866210938f)));
  const __m512 t2 = _mm512_mul_ps(z, _mm512_add_ps(_mm512_mul_ps(w, _mm512_set1_ps(0.284987866878509521484375f)),
                                                   _mm512_set1_ps(0.666666626930236816406250f)));
  const __m512 r = _mm512_add_ps(t2, t1);
  const __m512 hfsq = _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(0.5f)), f);
  const __m512 dk = _mm512_cvtepi32_ps(k);
  __m512 out = _mm512_mul_ps(s, _mm512_add_ps(hfsq, r));
  out = _mm512_add_ps(out, _mm512_mul_ps(dk, _mm512_set1_ps(9.05800061445916071534e-06f)));
  out = _mm512_sub_ps(out, hfsq);
  out = _mm512_add_ps(out, f);
  return _mm512_add_ps(out, _mm512_mul_ps(dk, _mm512_set1_ps(0.693138122558593750f)));
}

// gumbel_of() on 16 hash prefixes idx (each < 2**23).
KG_AVX512 inline __m512 gumbel16(__m512i idx) {
  const __m512 u = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(idx), _mm512_set1_ps(1.1920928955078125e-07f)),
                                 _mm512_set1_ps(5.9604644775390625e-08f));
  return neg16(det_log16(neg16(det_log16(u))));
}

// bucket_of() on 16 lanes, read off the exponent of float(d) (exact below 2**24).
KG_AVX512 inline __m512i bucket16(__m512i idx) {
  const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(set1u(0x7FFFFFu), idx));
  const __m512i e = _mm512_srli_epi32(_mm512_castps_si512(d), 23);  // 0 for d = 0, else 127 + log2(d)
  return _mm512_max_epi32(_mm512_sub_epi32(e, set1u(126u)), _mm512_setzero_si512());
}

// The bound of bucket(idx) per lane (kNoiseBounds in two registers, one permute).
KG_AVX512 inline __m512 noise_bound16(__m512i idx) {
  const __m512 lo = _mm512_loadu_ps(kNoiseBounds.by_bucket), hi = _mm512_loadu_ps(kNoiseBounds.by_bucket + 16);
  return _mm512_permutex2var_ps(lo, bucket16(idx), hi);
}

// 16 scores of dtype T (one register of float, two of double) and the comparisons the row needs;
// lanes outside the mask m are -inf and never reported.
template <typename T>
struct Pack16;

template <>
struct Pack16<float> {
  __m512 v;
  KG_AVX512 static Pack16 load(const float* p, __mmask16 m) {
    return {_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p)};
  }
  KG_AVX512 Pack16 plus(float x) const { return {_mm512_add_ps(v, _mm512_set1_ps(x))}; }
  KG_AVX512 Pack16 plus(__m512 g) const { return {_mm512_add_ps(v, g)}; }
  template <int P>
  KG_AVX512 __mmask16 cmp(float x, __mmask16 m) const { return _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(x), P); }
  KG_AVX512 float max(__mmask16 m) const { return _mm512_mask_reduce_max_ps(m, v); }
};

template <>
struct Pack16<double> {
  __m512d lo, hi;
  KG_AVX512 static Pack16 load(const double* p, __mmask16 m) {
    const __m512d ninf = _mm512_set1_pd(-INFINITY);
    return {_mm512_mask_loadu_pd(ninf, __mmask8(m), p), _mm512_mask_loadu_pd(ninf, __mmask8(m >> 8), p + 8)};
  }
  KG_AVX512 Pack16 plus(double x) const { return {_mm512_add_pd(lo, _mm512_set1_pd(x)), _mm512_add_pd(hi, _mm512_set1_pd(x))}; }
  KG_AVX512 Pack16 plus(__m512 g) const {  // g widened exactly, then added in double
    const __m256 g_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1));
    return {_mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(g))), _mm512_add_pd(hi, _mm512_cvtps_pd(g_hi))};
  }
  template <int P>
  KG_AVX512 __mmask16 cmp(double x, __mmask16 m) const {
    const __m512d b = _mm512_set1_pd(x);
    return __mmask16(_mm512_mask_cmp_pd_mask(__mmask8(m), lo, b, P) |
                     (unsigned(_mm512_mask_cmp_pd_mask(__mmask8(m >> 8), hi, b, P)) << 8));
  }
  KG_AVX512 double max(__mmask16 m) const {
    return std::max(_mm512_mask_reduce_max_pd(__mmask8(m), lo), _mm512_mask_reduce_max_pd(__mmask8(m >> 8), hi));
  }
};

KG_AVX512 inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// The probe of row_argmax (same top[]), 16 scores per comparison with the current 16th highest;
// false if the row has a NaN.
template <typename T>
KG_AVX512 bool probe_avx512(const T* s, int64_t v, int64_t* top, int& n_top) {
  int64_t j = 0;
  for (; j < v && n_top < kProbe; ++j) {
    if (s[j] != s[j]) return false;
    probe_insert(s, j, top, n_top);
  }
  for (; j < v; j += 16) {
    const __mmask16 valid = first_lanes(v - j);
    const Pack16<T> x = Pack16<T>::load(s + j, valid);
    if (x.template cmp<_CMP_UNORD_Q>(0, valid)) return false;
    // the lanes above the 16th highest, in id order (each insertion may raise the threshold)
    for (uint32_t gt = x.template cmp<_CMP_GT_OQ>(s[top[kProbe - 1]], valid); gt; gt &= gt - 1)
      probe_insert(s, j + __builtin_ctz(gt), top, n_top);
  }
  return true;
}

// Scores the 16 tokens ids (lanes m) whose scores are x, and keeps the best (lowest id on ties).
template <typename T>
KG_AVX512 inline void score16(const Pack16<T>& x, __m512i ids, __mmask16 m, __m512i h, T& best, int64_t& arg) {
  const __m512i idx = _mm512_srli_epi32(finish16(h, ids), 9);
  const __mmask16 live = x.plus(noise_bound16(idx)).template cmp<_CMP_GE_OQ>(best, m);
  if (!live) return;  // no lane can reach the best score, whatever its exact noise
  const Pack16<T> sc = x.plus(gumbel16(idx));
  const __mmask16 ge = sc.template cmp<_CMP_GE_OQ>(best, live);
  if (!ge) return;
  const T top = sc.max(ge);
  const __mmask16 eq = sc.template cmp<_CMP_EQ_OQ>(top, ge);
  alignas(64) uint32_t id[16];
  _mm512_store_si512(id, ids);
  const int64_t j = id[__builtin_ctz(eq)];  // lanes are in id order: the first is the lowest
  if (top > best || j < arg) best = top, arg = j;
}

// row_argmax, vectorised (v < 2**31: token ids are int32 lanes): each chunk of 16 tokens with a
// candidate is hashed as a whole, and its logarithms are taken only if a lane passes the bucket
// bound (see kNoiseBounds).
template <typename T>
KG_AVX512 int64_t row_argmax_avx512(const T* s, int64_t v, uint32_t h, T hi) {
  int64_t top[kProbe];
  int n_top = 0;
  if (!probe_avx512(s, v, top, n_top)) return -1;
  int64_t arg;
  T best = probe_best(s, top, n_top, h, arg);
  const __m512i hv = set1u(h), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t j = 0; j < v; j += 16) {
    const __mmask16 valid = first_lanes(v - j);
    const Pack16<T> x = Pack16<T>::load(s + j, valid);
    const __mmask16 cand = x.plus(hi).template cmp<_CMP_GE_OQ>(best, valid);
    if (cand) score16(x, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(j)), lane), cand, hv, best, arg);
  }
  return arg;
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return yes;
}

// gumbel16 (bound = false) or noise_bound16 (bound = true) of idx[0..n).
KG_AVX512 void gumbel_values_avx512(const int32_t* idx, float* out, int64_t n, bool bound) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first_lanes(n - i);
    const __m512i x = _mm512_maskz_loadu_epi32(m, idx + i);
    _mm512_mask_storeu_ps(out + i, m, bound ? noise_bound16(x) : gumbel16(x));
  }
}
#else
bool has_avx512() { return false; }
#endif

// Which row function a call uses: the AVX-512 one if asked for, built, supported and the
// vocabulary fits its int32 lanes; else the scalar one.
template <typename T>
auto pick_row_fn(bool vector, int64_t v) -> int64_t (*)(const T*, int64_t, uint32_t, T) {
#if defined(__x86_64__)
  if (vector && has_avx512() && v <= (int64_t(1) << 31)) return &row_argmax_avx512<T>;
#endif
  return &row_argmax<T>;
}

using I64 = py::array_t<int64_t, py::array::c_style>;

template <typename T>
py::array_t<int64_t> keyed_argmax(py::array_t<T, py::array::c_style> scores, uint64_t seed, uint32_t step,
                                  I64 uid, I64 sample_idx, I64 position, double hi_in, int threads, bool vector) {
  const int64_t n = scores.ndim() == 2 ? scores.shape(0) : -1, v = scores.ndim() == 2 ? scores.shape(1) : 0;
  if (n < 0 || uid.ndim() != 1 || uid.shape(0) != n || sample_idx.ndim() != 1 || sample_idx.shape(0) != n ||
      position.ndim() != 1 || position.shape(0) != n)
    throw std::invalid_argument("keyed_argmax: scores must be [N, V] and uid, sample_idx, position [N]");
  if (v < 1 || v > (int64_t(1) << 32)) throw std::invalid_argument("keyed_argmax: vocabulary size out of range");
  py::array_t<int64_t> out(n);
  const T* s_all = scores.data();
  const int64_t *pu = uid.data(), *ps = sample_idx.data(), *pp = position.data();
  int64_t* o = out.mutable_data();
  const T hi = static_cast<T>(hi_in);
  const auto row_fn = pick_row_fn<T>(vector, v);
  {
    py::gil_scoped_release release;
    // Rows are independent and each writes its own output: split them over threads (strided),
    // the result does not depend on the split.
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, n));
    auto work = [&](int64_t first) {
      for (int64_t r = first; r < n; r += nt) o[r] = row_fn(s_all + r * v, v, row_state(seed, step, pu[r], ps[r], pp[r]), hi);
    };
    std::vector<std::thread> pool;
    for (int64_t k = 1; k < nt; ++k) pool.emplace_back(work, k);
    work(0);
    for (auto& th : pool) th.join();
  }
  return out;
}

// The noise (bound = false), or the bucket bound the kernel prunes with (bound = true), of hash
// prefixes idx, by the AVX-512 path where vector and the CPU allow it, else the scalar one: for
// the parity tests.
py::array_t<float> prefix_noise(py::array_t<int64_t, py::array::c_style> idx, bool vector, bool bound) {
  std::vector<int32_t> narrow(idx.size());
  const int64_t* in = idx.data();
  for (size_t i = 0; i < narrow.size(); ++i) {
    if (in[i] < 0 || in[i] >= (int64_t(1) << 23)) throw std::invalid_argument("idx must be in [0, 2**23)");
    narrow[i] = static_cast<int32_t>(in[i]);
  }
  py::array_t<float> out(idx.size());
  float* o = out.mutable_data();
#if defined(__x86_64__)
  if (vector && has_avx512()) {
    gumbel_values_avx512(narrow.data(), o, idx.size(), bound);
    return out;
  }
#endif
  for (size_t i = 0; i < narrow.size(); ++i) {
    const uint32_t x = static_cast<uint32_t>(narrow[i]);
    o[i] = bound ? kNoiseBounds.by_bucket[bucket_of(x)] : gumbel_of(x);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_keyed_gumbel, m) {
  m.doc() = "Fused counter-based Gumbel-max sampling (twin of megarl.engine.sampler.sample_keyed)";
  m.def("keyed_argmax_f32", &keyed_argmax<float>, py::arg("scores"), py::arg("seed"), py::arg("step"),
        py::arg("uid"), py::arg("sample_idx"), py::arg("position"), py::arg("hi"), py::arg("threads") = 1,
        py::arg("vector") = true,
        "Per row of float32 scores [N, V]: argmax_v(scores + g(key, v)), pruned exactly; -1 for a row with NaN. "
        "vector: the AVX-512 path where the CPU has it (same result), else the scalar one.");
  m.def("keyed_argmax_f64", &keyed_argmax<double>, py::arg("scores"), py::arg("seed"), py::arg("step"),
        py::arg("uid"), py::arg("sample_idx"), py::arg("position"), py::arg("hi"), py::arg("threads") = 1,
        py::arg("vector") = true, "The same for float64 scores (the float32 noise widened).");
  m.def("gumbel_values", [](py::array_t<int64_t, py::array::c_style> idx, bool vector) {
          return prefix_noise(idx, vector, false); }, py::arg("idx"), py::arg("vector") = true,
        "The noise of hashes whose top 23 bits are idx (float32), for the parity tests.");
  m.def("gumbel_bounds", [](py::array_t<int64_t, py::array::c_style> idx, bool vector) {
          return prefix_noise(idx, vector, true); }, py::arg("idx"), py::arg("vector") = true,
        "The bound on the noise that the kernel prunes with before the logarithms, per hash prefix idx "
        "(for the tests).");
  m.attr("avx512") = has_avx512();  // whether vector=True runs the AVX-512 path on this CPU
}
