// megarl._keyed_gumbel: the Gumbel-max token of each row of a CPU sampler, fused in one pass.
//
// The torch reference is megarl/engine/sampler.py (`sample_keyed`, `_finish`, `_gumbel`) and
// megarl/engine/detmath.py (`det_log`); this file computes the same bits. In torch the noise of
// one (row, token) is ~60 separate elementwise kernels over int64/float32 tensors, each written to
// memory: ~3.5 ms per row of a 49k vocabulary on the CPUs here, as much as a SmolLM2 decode step
// at batch 1. Here it is ~60 scalar operations in registers, and only for the tokens that can
// still win.
//
// Why the result is bit for bit the torch one:
// - The hash is 32-bit integer arithmetic (murmur3's last round and finaliser), exact anywhere.
// - The noise is a function of the hash's top 23 bits only; `gumbel_of` repeats `_gumbel`'s float32
//   operations one by one (u = idx * 2**-23 + 2**-24 is exact; det_log is the musl logf sequence
//   of detmath.py). Every operation is an IEEE-754 float32 op, correctly rounded; the build passes
//   -ffp-contract=off so that no multiply-add is fused, and x86-64 evaluates float in float
//   (FLT_EVAL_METHOD 0). tests/engine/test_keyed_gumbel.py compares all 2**23 values with torch's.
// - Scores are `s + g` in the sampler's dtype (float or double, g widened exactly), as torch adds
//   them; the argmax takes the first maximum, as torch.argmax does.
// - Pruning: fl(s_v + g_v) <= fl(s_v + hi) for every noise value (hi bounds them all; rounding is
//   monotone). The row's 16 highest scores are scored first (sampler.PROBE); a token whose
//   fl(s_v + hi) is below the best score so far scores strictly below the final maximum and is
//   skipped without hashing.
// Rows with NaN are left to the caller (torch's argmax semantics for NaN are not repeated here).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

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

using I64 = py::array_t<int64_t, py::array::c_style>;

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

// The Gumbel-max token of one row of scores s[0..v) under the key state h (no NaN in s).
template <typename T>
int64_t row_argmax(const T* s, int64_t v, uint32_t h, T hi) {
  // The kProbe highest scores (ties: lower id first), kept sorted in a small array.
  int64_t top[kProbe];
  int n_top = 0;
  for (int64_t j = 0; j < v; ++j) {
    if (n_top == kProbe && !(s[j] > s[top[kProbe - 1]])) continue;
    int i = n_top < kProbe ? n_top++ : kProbe - 1;
    while (i > 0 && s[j] > s[top[i - 1]]) {
      top[i] = top[i - 1];
      --i;
    }
    top[i] = j;
  }
  auto score = [&](int64_t j) { return s[j] + static_cast<T>(gumbel_of(finish(h, static_cast<uint32_t>(j)) >> 9)); };
  int64_t arg = top[0];
  T best = score(arg);
  for (int i = 1; i < n_top; ++i) {
    const T sc = score(top[i]);
    if (sc > best || (sc == best && top[i] < arg)) best = sc, arg = top[i];
  }
  // Every other token that can still reach the best score so far (the probed ones are scored
  // again: same score, and the tie rule keeps the lowest id).
  for (int64_t j = 0; j < v; ++j) {
    if (!(s[j] + hi >= best)) continue;
    const T sc = score(j);
    if (sc > best || (sc == best && j < arg)) best = sc, arg = j;
  }
  return arg;
}

template <typename T>
py::array_t<int64_t> keyed_argmax(py::array_t<T, py::array::c_style> scores, uint64_t seed, uint32_t step,
                                  I64 uid, I64 sample_idx, I64 position, double hi_in, int threads) {
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
  {
    py::gil_scoped_release release;
    // Rows are independent and each writes its own output: split them over threads (strided),
    // the result does not depend on the split.
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, n));
    auto work = [&](int64_t first) {
      for (int64_t r = first; r < n; r += nt) o[r] = row_argmax(s_all + r * v, v, row_state(seed, step, pu[r], ps[r], pp[r]), hi);
    };
    std::vector<std::thread> pool;
    for (int64_t k = 1; k < nt; ++k) pool.emplace_back(work, k);
    work(0);
    for (auto& th : pool) th.join();
  }
  return out;
}

py::array_t<float> gumbel_values(py::array_t<int64_t, py::array::c_style> idx) {
  py::array_t<float> out(idx.size());
  const int64_t* in = idx.data();
  float* o = out.mutable_data();
  for (py::ssize_t i = 0; i < idx.size(); ++i) {
    if (in[i] < 0 || in[i] >= (int64_t(1) << 23)) throw std::invalid_argument("gumbel_values: idx must be in [0, 2**23)");
    o[i] = gumbel_of(static_cast<uint32_t>(in[i]));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_keyed_gumbel, m) {
  m.doc() = "Fused counter-based Gumbel-max sampling (twin of megarl.engine.sampler.sample_keyed)";
  m.def("keyed_argmax_f32", &keyed_argmax<float>, py::arg("scores"), py::arg("seed"), py::arg("step"),
        py::arg("uid"), py::arg("sample_idx"), py::arg("position"), py::arg("hi"), py::arg("threads") = 1,
        "Per row of float32 scores [N, V]: argmax_v(scores + g(key, v)), pruned exactly.");
  m.def("keyed_argmax_f64", &keyed_argmax<double>, py::arg("scores"), py::arg("seed"), py::arg("step"),
        py::arg("uid"), py::arg("sample_idx"), py::arg("position"), py::arg("hi"), py::arg("threads") = 1,
        "The same for float64 scores (the float32 noise widened).");
  m.def("gumbel_values", &gumbel_values, py::arg("idx"),
        "The noise of hashes whose top 23 bits are idx (float32), for the parity test.");
}
