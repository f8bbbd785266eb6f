// Fused CPU kernel for exact Focus sparse attention (hard routing), spec section 5.
//
// One call computes, for every query i at absolute position p_i = offset + i,
//   softmax over the keys j with j <= p_i, key j real, and
//   (p_i - j < window  or  the two tokens share at least one group),
// as two disjoint parts merged by log-sum-exp:
//   phase 1 (group part): queries are partitioned by their exact membership set S (a
//     "class"); a tile of up to `tile_q` class queries attends causally (by position) to
//     the union of the real keys of every group in S, found by a scan of the keys' group
//     bit codes (a key in several groups of S is visited once); where every key is in one
//     group at most (or in all: sinks) and the classes are small (queries in several
//     groups), by single group instead: the keys are laid out group by group once, and for
//     each block of consecutive queries and each group, the block's queries in it attend to
//     its keys, the groups merged into the block's rows by log-sum-exp (group_block);
//   phase 2 (local part): tiles of consecutive queries attend to the contiguous keys of
//     their window, masked to pairs that share no group, and merge into phase 1's rows.
// Each tile runs flash-attention style (key blocks, online softmax) on fp32 copies of the
// gathered rows, with MKL's sgemm for the two products; nothing of size Nq x Nk exists.
// With few query rows phase 1 also splits each tile's keys into position segments, merged
// by log-sum-exp before phase 2, so that every thread has work (split-K, as in
// flash-decoding).
// A call with one query (a decoding step) takes a shorter path: no classes are planned;
// per batch element, key head and position segment, the visible keys (the window's, and
// before it those sharing a group, found from the bool masks directly) are listed, their
// key and value rows read in place (no tile copies) with a two-pass softmax, and the
// segments merged by log-sum-exp.
// Work items are sorted by estimated cost and pulled from an atomic counter by every
// thread (a causal workload is triangular: static splits would be unbalanced).
// Product decision: written for the CPU machines this project runs on; the Python side
// falls back to calls of PyTorch's CPU flash kernel if this file cannot be built.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <tuple>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// C[m x n] (row stride ldc) = alpha * A[m x k] * B[n x k]^T (row-major operands).
inline void gemm_abt(int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                     int ldb, float* c, int ldc) {
  const float beta = 0.f;
  sgemm_("T", "N", &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

// C[m x n] += A[m x k] * B[k x n] (row-major operands).
inline void gemm_ab_add(int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                        float* c, int ldc) {
  const float one = 1.f;
  sgemm_("N", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &one, c, &ldc);
}

// exp(x) for x <= 0 (Cephes polynomial, ~1 ulp); exactly 0 below -87 and for -inf, NaN
// for NaN (a NaN input must not vanish from the softmax). Branch-free.
inline float exp_nonpositive(float x) {
  const bool under = x < -87.f;  // false for NaN
  const float xc = under ? 0.f : x;
  const float n0 = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float n = n0 == n0 ? n0 : 0.f;  // NaN: any exponent, the polynomial stays NaN
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return under ? 0.f : p * scale;
}

#ifdef __AVX2__
// 8 lanes of exp_nonpositive (same polynomial and cut-off).
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);  // false for NaN
  x = _mm256_max_ps(lo, x);  // keeps a NaN x (max returns its second operand then)
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// max of x[0..n); NaN if any x[j] is NaN (max instructions alone may drop a NaN)
inline float row_max(const float* x, int64_t n) {
  float mx = kNegInf;
  bool nan = false;
  int64_t j = 0;
#ifdef __AVX2__
  __m256 v = _mm256_set1_ps(kNegInf), bad = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 xj = _mm256_loadu_ps(x + j);
    v = _mm256_max_ps(v, xj);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(xj, xj, _CMP_UNORD_Q));
  }
  mx = hmax8(v);
  nan = _mm256_movemask_ps(bad) != 0;
#endif
  for (; j < n; ++j) {
    mx = std::max(mx, x[j]);
    nan |= x[j] != x[j];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : mx;
}

// x[j] = exp(x[j] - shift) for j < n (x[j] <= shift); returns the sum
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  float sum = 0.f;
  int64_t j = 0;
#ifdef __AVX2__
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + j), sh));
    _mm256_storeu_ps(x + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  sum = hsum8(acc);
#endif
  for (; j < n; ++j) {
    x[j] = exp_nonpositive(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

template <typename T>
inline void load_row(float* dst, const T* src, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, sizeof(float) * d);
  } else {
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(src[e]);
  }
}

// An uninitialised array (a std::vector would zero it: for a decoding step the tile buffers
// of every thread and call would be cleared, many times the work of the step itself).
template <typename T>
struct Buffer {
  std::unique_ptr<T[]> p;
  void resize(int64_t n) { p.reset(new T[static_cast<size_t>(std::max<int64_t>(n, 1))]); }
  T* data() const { return p.get(); }
  T* begin() const { return p.get(); }
  T& operator[](int64_t i) const { return p[i]; }
};

// a . b over d floats
inline float dot(const float* a, const float* b, int64_t d) {
  int64_t e = 0;
  float s = 0.f;
#ifdef __AVX2__
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; e + 16 <= d; e += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 8), _mm256_loadu_ps(b + e + 8), s1);
  }
  for (; e + 8 <= d; e += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), s0);
  s = hsum8(_mm256_add_ps(s0, s1));
#endif
  for (; e < d; ++e) s += a[e] * b[e];
  return s;
}

template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < static_cast<int64_t>(sizeof(T)) * d; off += 64) __builtin_prefetch(p + off);
}

// Scratch of one thread in a decoding step: the logits of the rep query rows against the
// visible keys of one segment, and fp32 rows.
struct DecodeScratch {
  const int64_t* idx = nullptr;  // the visible keys of the item's segment
  Buffer<float> s, q, acc, row;
  void reserve(int64_t keys, int64_t rows, int64_t d) {
    s.resize(rows * keys);
    q.resize(rows * d);
    acc.resize(rows * d);
    row.resize(d);
  }
};

// Running state of one tile: rows = rep heads x n queries (row r*n + i is head hk*rep+r,
// query i of the tile).
struct TileState {
  int64_t rows = 0, d = 0, tile_k = 0;
  Buffer<float> q, k, v, s, acc, m, l;
  Buffer<int64_t> kpos;
  void reserve(int64_t max_rows, int64_t head_dim, int64_t tk) {
    d = head_dim;
    tile_k = tk;
    q.resize(max_rows * d);
    acc.resize(max_rows * d);
    s.resize(max_rows * tk);
    m.resize(max_rows);
    l.resize(max_rows);
    k.resize(tk * d);
    v.resize(tk * d);
    kpos.resize(tk);
  }
  void start(int64_t r) {
    rows = r;
    std::fill(acc.begin(), acc.begin() + r * d, 0.f);
    std::fill(m.begin(), m.begin() + r, kNegInf);
    std::fill(l.begin(), l.begin() + r, 0.f);
  }
  // One key block of nk keys whose masked logits are in s (-inf = hidden) and value rows at
  // vals (default: the tile's own v).
  void update(int64_t nk, const float* vals = nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      float* srow = s.data() + r * tile_k;
      const float mx = row_max(srow, nk);
      if (mx == kNegInf) {  // nothing visible in this block: P = 0
        std::fill(srow, srow + nk, 0.f);
        continue;
      }
      const float mnew = mx != mx ? mx : std::max(m[r], mx);  // NaN stays NaN
      const float sum = exp_shift_sum(srow, nk, mnew);
      const float alpha = m[r] == kNegInf ? 0.f : std::exp(m[r] - mnew);
      if (alpha != 1.f) {
        float* a = acc.data() + r * d;
        for (int64_t e = 0; e < d; ++e) a[e] *= alpha;
      }
      l[r] = l[r] * alpha + sum;
      m[r] = mnew;
    }
    gemm_ab_add(rows, d, nk, s.data(), tile_k, vals ? vals : v.data(), d, acc.data(), d);
  }
};

struct Item {
  int64_t batch, problem, row0, row1, head_kv;
  double cost;
  int64_t segment = 0, key_lo = 0, key_hi = 0;  // phase 1: keys [key_lo, key_hi) only
};

// Per batch element: classes (query lists by exact membership code) and bit codes.
template <typename C>  // membership code type: uint8_t .. uint64_t by the number of groups
struct Plan {
  std::vector<C> class_code;          // [C]
  std::vector<int64_t> class_start;   // [C + 1] into class_rows
  std::vector<int32_t> class_rows;    // [Nq] query indices, sorted within each class
  std::vector<C> qcode, kcode;        // membership bit codes (kcode 0 for padding)
  bool keys_single = true;            // every key in one group at most, or in all (sinks)
  int64_t most_query_groups = 0;      // the most groups one query is in
};

// The real keys of one (batch element, key head) laid out group by group, each key in one
// group or in all of them (phase 1 by single group): group g's keys at [start[g],
// start[g + 1]) and, as a group K, the keys in every group (sinks) at [start[K],
// start[K + 1]), each increasing in position, with their fp32 key and value rows one after
// the other.
struct GroupedKeys {
  std::vector<int64_t> start;  // [K + 2]
  std::vector<int64_t> pos;    // [keys]
  Buffer<float> k, v;          // [keys, D]
};

// A worker's buffers for group_block: one group's tile of the block's queries (ts, rows:
// their indices) and the block's running softmax over its groups (row r * n + i: head
// hk * rep + r, query i of the block).
struct BlockScratch {
  TileState ts;
  Buffer<float> acc, m, l;
  std::vector<int32_t> rows;
  void reserve(int64_t max_rows, int64_t d, int64_t tile_k) {
    ts.reserve(max_rows, d, tile_k);
    acc.resize(max_rows * d);
    m.resize(max_rows);
    l.resize(max_rows);
  }
};

// Bit code of n bools (bytes of 0 or 1): bit g set where b[g]. Eight at a time, one byte each
// to one bit by a multiply (little-endian loads; torch's bools are exactly 0 or 1).
inline uint64_t pack_bools(const bool* b, int64_t n) {
  uint64_t code = 0;
  for (int64_t g0 = 0; g0 < n; g0 += 8) {
    uint64_t x = 0;
    std::memcpy(&x, b + g0, static_cast<size_t>(std::min<int64_t>(8, n - g0)));
    code |= ((x * 0x0102040810204080ULL) >> 56) << g0;
  }
  return code;
}

// One normalised output row of d values from an unnormalised running softmax (acc, max m,
// sum l) into o, its log-sum-exp into ls: zeros and -inf where nothing was visible (l = 0);
// a NaN sum (from NaN inputs) is propagated, not hidden.
inline void write_normalised(float* o, float& ls, const float* acc, float m, float l,
                             int64_t d) {
  if (l != 0.f) {
    const float inv = 1.f / l;
    for (int64_t e = 0; e < d; ++e) o[e] = acc[e] * inv;
    ls = m + std::log(l);
  } else {
    std::fill(o, o + d, 0.f);
    ls = kNegInf;
  }
}

// The code of a token in every one of K groups (a sink, as the caches store them).
template <typename C>
inline C all_groups(int64_t kgroups) {
  return static_cast<C>(kgroups >= 64 ? ~uint64_t{0} : (uint64_t{1} << kgroups) - 1);
}

template <typename C>
// qg / kg: token i's K memberships at qg + i * stride (stride K for memberships shared by
// the heads, H_kv * K for one key-value head's of [N, H_kv, K])
Plan<C> make_plan(const bool* qg, const bool* kg, const bool* real, int64_t nq, int64_t nk,
               int64_t kgroups, int64_t stride) {
  Plan<C> p;
  p.qcode.resize(nq);
  p.kcode.resize(nk);
  for (int64_t i = 0; i < nq; ++i) {
    p.qcode[i] = static_cast<C>(pack_bools(qg + i * stride, kgroups));
    p.most_query_groups = std::max<int64_t>(p.most_query_groups,
                                            __builtin_popcountll(static_cast<uint64_t>(p.qcode[i])));
  }
  const C every = all_groups<C>(kgroups);
  for (int64_t j = 0; j < nk; ++j) {
    const bool keep = real == nullptr || real[j];
    p.kcode[j] = keep ? static_cast<C>(pack_bools(kg + j * stride, kgroups)) : C{0};
    p.keys_single &= (p.kcode[j] & (p.kcode[j] - 1)) == 0 || p.kcode[j] == every;
  }
  // classes: queries sorted by (code, index); code 0 (no group) gets no class
  std::vector<int32_t> order(nq);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return p.qcode[a] < p.qcode[b]; });
  for (int64_t t = 0; t < nq; ++t) {
    const C c = p.qcode[order[t]];
    if (c == 0) continue;
    if (p.class_code.empty() || p.class_code.back() != c) {
      p.class_code.push_back(c);
      p.class_start.push_back(static_cast<int64_t>(p.class_rows.size()));
    }
    p.class_rows.push_back(order[t]);
  }
  p.class_start.push_back(static_cast<int64_t>(p.class_rows.size()));
  return p;
}

// Walks, in increasing order, the keys whose code shares a bit with `code`: the union of
// the real keys of the groups in `code`, each key once. A scan of the 1-8 byte codes costs
// little next to the rows it gathers.
template <typename C>
struct KeyUnion {
  const C* kcode;
  C code;
  int64_t j = 0, nk;
  KeyUnion(const std::vector<C>& codes, C class_code)
      : kcode(codes.data()), code(class_code), nk(static_cast<int64_t>(codes.size())) {}
  // next key <= limit, or -1
  int64_t next(int64_t limit) {
    const int64_t stop = std::min(limit + 1, nk);
    while (j < stop && (kcode[j] & code) == 0) ++j;
    return j < stop ? j++ : -1;
  }
};

template <typename T, typename C>
struct Kernel {
  const T *q, *k, *v;
  const bool* real;  // [B, Nk] or null
  float *out, *lse;  // [B, Nq, H, D], [B, Nq, H]
  int64_t b, h, hkv, nq, nk, d, rep, window, offset, tile_q, tile_k, tile_band;
  int64_t k_batch_stride, k_head_stride, v_batch_stride, v_head_stride;  // rows are contiguous
  int64_t segment_keys = 0;  // phase 1 splits the keys into segments of at least this many
  int64_t segments = 1;      // when it has too few items for the threads (decoding)
  // [segments, B, Nq, H, (D)] partial results of key segments; part_out is read only where
  // part_lse is finite
  mutable Buffer<float> part_out, part_lse;
  // phase 1 by single group over blocks of consecutive queries (group_block), on the keys
  // laid out group by group (grouped, [B * H_kv]); by_group_block queries per block
  bool by_group = false;
  int64_t by_group_block = 0;
  std::vector<GroupedKeys> grouped;
  float scale;
  int64_t routes = 1;  // memberships per batch element: 1 (shared by the heads) or H_kv
  std::vector<Plan<C>> plans;  // [B * routes]

  // the plan of key head hk of batch element bi
  const Plan<C>& plan(int64_t bi, int64_t hk) const {
    return plans[bi * routes + (routes > 1 ? hk : 0)];
  }

  const T* q_row(int64_t bi, int64_t head, int64_t i) const {
    return q + ((bi * h + head) * nq + i) * d;
  }
  const T* k_row(int64_t bi, int64_t head, int64_t j) const {
    return k + bi * k_batch_stride + head * k_head_stride + j * d;
  }
  const T* v_row(int64_t bi, int64_t head, int64_t j) const {
    return v + bi * v_batch_stride + head * v_head_stride + j * d;
  }

  // logits of the tile's rows against the block's nk keys, scaled, into ts.s
  void logits(TileState& ts, int64_t n, int64_t nkb) const {
    gemm_abt(static_cast<int>(rep * n), static_cast<int>(nkb), static_cast<int>(d), scale,
             ts.q.data(), static_cast<int>(d), ts.k.data(), static_cast<int>(d), ts.s.data(),
             static_cast<int>(ts.tile_k));
  }

  // Hides, in the tile's logits against a key block at positions kpos[0..nkb) (increasing),
  // the keys after each query rows[i] (i < n), for each of its rep heads; nothing to do
  // where the block ends at or before the first query.
  void causal_mask(TileState& ts, const int32_t* rows, int64_t n, const int64_t* kpos,
                   int64_t nkb) const {
    if (kpos[nkb - 1] <= offset + rows[0]) return;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t cut = std::upper_bound(kpos, kpos + nkb, offset + rows[i]) - kpos;
      for (int64_t r = 0; r < rep; ++r) {
        float* srow = ts.s.data() + (r * n + i) * ts.tile_k;
        std::fill(srow + cut, srow + nkb, kNegInf);
      }
    }
  }

  void load_queries(TileState& ts, int64_t bi, int64_t hk, const int32_t* rows, int64_t first,
                    int64_t n) const {
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t qi = rows ? rows[i] : first + i;
        load_row(ts.q.data() + (r * n + i) * d, q_row(bi, hk * rep + r, qi), d);
      }
  }

  // phase 1: class queries rows[0..n) against the union of the class's groups' keys
  void group_tile(TileState& ts, const Item& it) const {
    const Plan<C>& p = plan(it.batch, it.head_kv);
    const int32_t* rows = p.class_rows.data() + it.row0;
    const int64_t n = it.row1 - it.row0;
    const int64_t bi = it.batch, hk = it.head_kv;
    ts.start(rep * n);
    load_queries(ts, bi, hk, rows, 0, n);
    const int64_t last_pos = std::min(offset + rows[n - 1], it.key_hi - 1);
    KeyUnion<C> keys(p.kcode, p.class_code[it.problem]);
    keys.j = it.key_lo;
    while (true) {
      int64_t nkb = 0;
      for (; nkb < tile_k; ++nkb) {
        const int64_t j = keys.next(last_pos);
        if (j < 0) break;
        ts.kpos[nkb] = j;
        load_row(ts.k.data() + nkb * d, k_row(bi, hk, j), d);
        load_row(ts.v.data() + nkb * d, v_row(bi, hk, j), d);
      }
      if (nkb == 0) break;
      logits(ts, n, nkb);
      causal_mask(ts, rows, n, ts.kpos.data(), nkb);
      ts.update(nkb);
      if (nkb < tile_k) break;
    }
    write_group_tile(ts, it, rows, n);
  }

  // phase 1's normalised rows of a tile into out / lse, or into the partial results of the
  // item's key segment
  void write_group_tile(const TileState& ts, const Item& it, const int32_t* rows,
                        int64_t n) const {
    const int64_t bi = it.batch, hk = it.head_kv, plane = b * nq * h;
    float* out_base = segments > 1 ? part_out.data() + it.segment * plane * d : out;
    float* lse_base = segments > 1 ? part_lse.data() + it.segment * plane : lse;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t r = 0; r < rep; ++r) {
        const int64_t row = r * n + i, head = hk * rep + r;
        const int64_t at = (bi * nq + rows[i]) * h + head;
        write_normalised(out_base + at * d, lse_base[at], ts.acc.data() + row * d, ts.m[row],
                         ts.l[row], d);
      }
    }
  }

  // Hides, in the logits of a local tile's key block j0..j0+nkb, every key outside query
  // i's window [pos - window + 1, pos] (two fills per row) and, inside it, the keys that
  // are padding or share a group with the query (phase 1 counted those).
  void band_mask(TileState& ts, const Plan<C>& p, const bool* rl, int64_t first, int64_t n,
                 int64_t j0, int64_t nkb) const {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = offset + first + i;
      const int64_t lo = std::clamp<int64_t>(pos - window + 1 - j0, 0, nkb);
      const int64_t hi = std::clamp<int64_t>(pos + 1 - j0, lo, nkb);  // exclusive
      float* row0 = ts.s.data() + i * ts.tile_k;  // head r's row at row0 + r * n * tile_k
      const int64_t head_step = n * ts.tile_k;
      for (int64_t r = 0; r < rep; ++r) {
        std::fill(row0 + r * head_step, row0 + r * head_step + lo, kNegInf);
        std::fill(row0 + r * head_step + hi, row0 + r * head_step + nkb, kNegInf);
      }
      const C qc = p.qcode[first + i];
      const C* kc = p.kcode.data() + j0;
      if (qc == 0 && rl == nullptr) continue;
      for (int64_t t = lo; t < hi; ++t)
        if ((qc & kc[t]) != 0 || (rl != nullptr && !rl[j0 + t]))
          for (int64_t r = 0; r < rep; ++r) row0[r * head_step + t] = kNegInf;
    }
  }

  // phase 2: queries first..first+n (in order) against their window's keys that share no
  // group, merged into phase 1's result (rows without a class start empty)
  void band_tile(TileState& ts, const Item& it) const {
    const Plan<C>& p = plan(it.batch, it.head_kv);
    const int64_t bi = it.batch, hk = it.head_kv, first = it.row0, n = it.row1 - it.row0;
    const bool* rl = real ? real + bi * nk : nullptr;
    ts.start(rep * n);
    load_queries(ts, bi, hk, nullptr, first, n);
    const int64_t lo = std::max<int64_t>(0, offset + first - window + 1);
    const int64_t hi = std::min<int64_t>(nk, offset + first + n);  // exclusive
    for (int64_t j0 = lo; j0 < hi; j0 += tile_k) {
      const int64_t nkb = std::min<int64_t>(tile_k, hi - j0);
      for (int64_t t = 0; t < nkb; ++t) {
        load_row(ts.k.data() + t * d, k_row(bi, hk, j0 + t), d);
        load_row(ts.v.data() + t * d, v_row(bi, hk, j0 + t), d);
      }
      logits(ts, n, nkb);
      band_mask(ts, p, rl, first, n, j0, nkb);
      ts.update(nkb);
    }
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = r * n + i, head = hk * rep + r, qi = first + i;
        float* o = out + ((bi * nq + qi) * h + head) * d;
        float& ls = lse[(bi * nq + qi) * h + head];
        const bool has_group = p.qcode[qi] != 0;
        const float l1 = has_group ? ls : kNegInf;
        if (ts.l[row] == 0.f) {  // no local part (a NaN sum goes on: NaN is propagated)
          if (!has_group) {
            std::fill(o, o + d, 0.f);
            ls = kNegInf;
          }
          continue;
        }
        const float l2 = ts.m[row] + std::log(ts.l[row]);
        const float* a = ts.acc.data() + row * d;
        if (l1 == kNegInf) {
          const float inv = 1.f / ts.l[row];
          for (int64_t e = 0; e < d; ++e) o[e] = a[e] * inv;
          ls = l2;
          continue;
        }
        const float mx = std::max(l1, l2);
        const float w1 = std::exp(l1 - mx), w2 = std::exp(l2 - mx);
        const float tot = w1 + w2;
        const float c1 = w1 / tot, c2 = w2 / (tot * ts.l[row]);
        for (int64_t e = 0; e < d; ++e) o[e] = o[e] * c1 + a[e] * c2;
        ls = mx + std::log(tot);
      }
  }

  // Runs body(scratch, t) for t in [0, total), pulled from an atomic counter by every
  // thread, each with its own scratch S prepared by init(scratch).
  template <typename S, typename Init, typename F>
  void pull(int64_t total, Init&& init, F&& body) const {
    std::atomic<int64_t> next{0};
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      S scratch;
      init(scratch);
      for (int64_t t = next.fetch_add(1); t < total; t = next.fetch_add(1)) body(scratch, t);
    });
  }

  // pull() with tile buffers for max_rows query rows
  template <typename F>
  void pull_tiles(int64_t total, int64_t max_rows, F&& body) const {
    pull<TileState>(total, [&](TileState& ts) { ts.reserve(max_rows, d, tile_k); }, body);
  }

  // phase 1's segments of one query row and head, merged by log-sum-exp into out / lse
  void merge_segments(int64_t bi, int64_t qi, int64_t head) const {
    const int64_t row = (bi * nq + qi) * h + head, seg_rows = b * nq * h;
    float* o = out + row * d;
    float mx = kNegInf;
    bool nan = false;
    for (int64_t sg = 0; sg < segments; ++sg) {
      const float ls = part_lse[sg * seg_rows + row];
      nan |= ls != ls;
      mx = std::max(mx, ls);
    }
    std::fill(o, o + d, 0.f);
    if (nan || mx == kNegInf) {
      if (nan) std::fill(o, o + d, std::numeric_limits<float>::quiet_NaN());
      lse[row] = nan ? std::numeric_limits<float>::quiet_NaN() : kNegInf;
      return;
    }
    float tot = 0.f;
    for (int64_t sg = 0; sg < segments; ++sg) {
      const float ls = part_lse[sg * seg_rows + row];
      if (ls == kNegInf) continue;
      const float w = std::exp(ls - mx);
      const float* po = part_out.data() + (sg * seg_rows + row) * d;
      for (int64_t e = 0; e < d; ++e) o[e] += w * po[e];
      tot += w;
    }
    for (int64_t e = 0; e < d; ++e) o[e] /= tot;
    lse[row] = mx + std::log(tot);
  }

  // Segments of phase 1: with fewer work items than about 4 per thread (a decoding step is
  // one item per key head), each item's keys are split so that every thread gets work.
  void plan_segments(int64_t group_items) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    segments = 1;
    if (segment_keys <= 0 || group_items == 0 || group_items >= 4 * threads) return;
    const int64_t wanted = (4 * threads + group_items - 1) / group_items;
    segments = std::max<int64_t>(1, std::min<int64_t>(wanted, nk / segment_keys));
    if (segments * b * nq * h * d > (int64_t{1} << 22)) segments = 1;  // partials <= 16 MiB
    if (segments > 1) allocate_parts();
  }

  void allocate_parts() {
    part_out.resize(segments * b * nq * h * d);
    part_lse.resize(segments * b * nq * h);
    std::fill(part_lse.begin(), part_lse.begin() + segments * b * nq * h, kNegInf);
  }

  // Phase 1 by single group instead of by exact membership set, where that is exact (every
  // key in one group at most, or in all of them as sinks are), needed (some query in several groups) and pays: the exact
  // sets are too many to fill tiles (under half a tile of queries each, on average). The
  // keys laid out group by group (2 B H_kv Nk D floats) must stay within 256 MiB.
  void choose_by_group() {
    int64_t classes = 0, most = 0;
    bool single = true;
    for (const Plan<C>& p : plans) {
      classes += static_cast<int64_t>(p.class_code.size());
      most = std::max(most, p.most_query_groups);
      single &= p.keys_single;
    }
    const int64_t rows = nq * static_cast<int64_t>(plans.size());
    if (!single || most < 2 || 2 * rows >= classes * tile_q) return;
    if (2 * b * hkv * nk * d > (int64_t{1} << 26)) return;
    by_group = true;
    // blocks of 4 tiles of queries (a group's share of them fills about half a tile at 4 of
    // 32 groups), smaller where the blocks would be too few for the threads
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t even = (b * hkv * nq + 4 * threads - 1) / (4 * threads);
    by_group_block = std::max(std::min(even, 4 * tile_q), std::min<int64_t>(32, nq));
    grouped.resize(b * hkv);
    at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) group_keys(t / hkv, t % hkv);
    });
  }

  // grouped[bi * hkv + hk]: the real keys of key head hk of batch element bi, group by group
  void group_keys(int64_t bi, int64_t hk) {
    const Plan<C>& p = plan(bi, hk);
    GroupedKeys& gk = grouped[bi * hkv + hk];
    // a key's slot: its one group, or kgroups for a key in several (then in all of them)
    const auto slot = [&](C c) -> int64_t {
      return (c & (c - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(c)) : kgroups;
    };
    gk.start.assign(kgroups + 2, 0);
    for (const C c : p.kcode)
      if (c) ++gk.start[slot(c) + 1];
    std::partial_sum(gk.start.begin(), gk.start.end(), gk.start.begin());
    const int64_t keys = gk.start[kgroups + 1];
    std::vector<int64_t> fill(gk.start.begin(), gk.start.end() - 1);
    gk.pos.resize(keys);
    gk.k.resize(keys * d);
    gk.v.resize(keys * d);
    for (int64_t j = 0; j < nk; ++j) {
      if (p.kcode[j] == 0) continue;
      const int64_t at = fill[slot(p.kcode[j])]++;
      gk.pos[at] = j;
      load_row(gk.k.data() + at * d, k_row(bi, hk, j), d);
      load_row(gk.v.data() + at * d, v_row(bi, hk, j), d);
    }
  }

  // One group's tile in group_block: the rows (rep x n, query indices sc.rows) against the
  // group's keys at or before the last of them (the n_keys rows at keys / vals, positions
  // pos), causally masked, into sc.ts.
  void group_keys_tile(BlockScratch& sc, int64_t bi, int64_t hk, const int64_t* pos,
                       const float* keys, const float* vals, int64_t n_keys) const {
    TileState& ts = sc.ts;
    const int64_t n = static_cast<int64_t>(sc.rows.size());
    ts.start(rep * n);
    load_queries(ts, bi, hk, sc.rows.data(), 0, n);
    for (int64_t c0 = 0; c0 < n_keys; c0 += tile_k) {
      const int64_t nkb = std::min(tile_k, n_keys - c0);
      gemm_abt(static_cast<int>(rep * n), static_cast<int>(nkb), static_cast<int>(d), scale,
               ts.q.data(), static_cast<int>(d), keys + c0 * d, static_cast<int>(d),
               ts.s.data(), static_cast<int>(ts.tile_k));
      causal_mask(ts, sc.rows.data(), n, pos + c0, nkb);
      ts.update(nkb, vals + c0 * d);
    }
  }

  // sc.ts's rows (sc.rows, of the block starting at query `first` with n queries) merged
  // into the block's running softmax by log-sum-exp (NaN propagated)
  void merge_into_block(BlockScratch& sc, int64_t first, int64_t n) const {
    const TileState& ts = sc.ts;
    const int64_t ns = static_cast<int64_t>(sc.rows.size());
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t t = 0; t < ns; ++t) {
        const int64_t from = r * ns + t, to = r * n + (sc.rows[t] - first);
        if (ts.l[from] == 0.f) continue;  // no key of this group visible
        const float* a = ts.acc.data() + from * d;
        float* acc = sc.acc.data() + to * d;
        if (sc.m[to] == kNegInf) {
          std::copy(a, a + d, acc);
          sc.m[to] = ts.m[from];
          sc.l[to] = ts.l[from];
          continue;
        }
        const float m1 = sc.m[to], m2 = ts.m[from];
        const float mx = (m1 != m1 || m2 != m2) ? m1 + m2 : std::max(m1, m2);
        const float w1 = std::exp(m1 - mx), w2 = std::exp(m2 - mx);
        for (int64_t e = 0; e < d; ++e) acc[e] = acc[e] * w1 + a[e] * w2;
        sc.l[to] = sc.l[to] * w1 + ts.l[from] * w2;
        sc.m[to] = mx;
      }
  }

  // phase 1 by single group: queries first..first+n (in order) of key head hk; for each
  // group, those of them in it attend to its keys (group_keys_tile), merged into the
  // block's rows, which are then written normalised into out / lse (rows in a group only)
  void group_block(BlockScratch& sc, const Item& it) const {
    const Plan<C>& p = plan(it.batch, it.head_kv);
    const GroupedKeys& gk = grouped[it.batch * hkv + it.head_kv];
    const int64_t first = it.row0, n = it.row1 - it.row0;
    std::fill(sc.acc.begin(), sc.acc.begin() + rep * n * d, 0.f);
    std::fill(sc.m.begin(), sc.m.begin() + rep * n, kNegInf);
    std::fill(sc.l.begin(), sc.l.begin() + rep * n, 0.f);
    for (int64_t g = 0; g <= kgroups; ++g) {  // g = kgroups: the keys in every group
      const C bit = g < kgroups ? static_cast<C>(uint64_t{1} << g) : all_groups<C>(kgroups);
      sc.rows.clear();
      for (int64_t i = first; i < first + n; ++i)
        if (p.qcode[i] & bit) sc.rows.push_back(static_cast<int32_t>(i));
      if (sc.rows.empty()) continue;
      const int64_t* pos = gk.pos.data() + gk.start[g];
      const int64_t n_keys =
          std::upper_bound(pos, gk.pos.data() + gk.start[g + 1], offset + sc.rows.back()) - pos;
      if (n_keys == 0) continue;
      group_keys_tile(sc, it.batch, it.head_kv, pos, gk.k.data() + gk.start[g] * d,
                      gk.v.data() + gk.start[g] * d, n_keys);
      merge_into_block(sc, first, n);
    }
    write_block(sc, p, it);
  }

  // the block's rows of queries in a group, normalised, into out / lse
  void write_block(const BlockScratch& sc, const Plan<C>& p, const Item& it) const {
    const int64_t n = it.row1 - it.row0;
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t qi = it.row0 + i, row = r * n + i, head = it.head_kv * rep + r;
        if (p.qcode[qi] == 0) continue;  // no group part: phase 2 alone
        const int64_t at = (it.batch * nq + qi) * h + head;
        write_normalised(out + at * d, lse[at], sc.acc.data() + row * d, sc.m[row], sc.l[row],
                         d);
      }
  }

  // phase 1 by single group: blocks of by_group_block queries per batch element and key head
  void run_by_group() const {
    const int64_t blocks = (nq + by_group_block - 1) / by_group_block;
    std::vector<Item> items;
    for (int64_t t = 0; t < b * hkv * blocks; ++t) {
      const int64_t r0 = t % blocks * by_group_block, r1 = std::min(nq, r0 + by_group_block);
      items.push_back({t / (hkv * blocks), 0, r0, r1, t / blocks % hkv,
                       static_cast<double>(r1 - r0) * static_cast<double>(offset + r1)});
    }
    std::sort(items.begin(), items.end(),
              [](const Item& x, const Item& y) { return x.cost > y.cost; });
    pull<BlockScratch>(
        static_cast<int64_t>(items.size()),
        [&](BlockScratch& sc) { sc.reserve(rep * by_group_block, d, tile_k); },
        [&](BlockScratch& sc, int64_t t) { group_block(sc, items[t]); });
  }

  // ---- decoding (Nq == 1): the query at position nk - 1 sees the real keys of its window
  // and, before it, the real keys that share one of its groups (their bit codes AND the
  // query's). Each (batch, key head,
  // position segment) reads its visible key and value rows once, in place (no tile
  // copies), with a two-pass softmax; segments merge by log-sum-exp (merge_segments).
  // [B, 1, routes, K], [B, Nk, routes, K] (routes 1: memberships shared by the heads)
  const bool *qg_bools = nullptr, *kg_bools = nullptr;
  int64_t kgroups = 0;
  static constexpr int64_t kAhead = 8;  // rows prefetched ahead of the one being read
  // [B * routes * segments]: the keys the query sees, per membership route and segment
  std::vector<std::vector<int64_t>> visible;

  // visible keys in [lo, hi) of batch element bi under membership route ro, increasing,
  // into idx
  void decode_keys(int64_t bi, int64_t ro, int64_t lo, int64_t hi,
                   std::vector<int64_t>& idx) const {
    const int64_t local_lo = std::max<int64_t>(0, nk - window), stride = routes * kgroups;
    const bool* rl = real ? real + bi * nk : nullptr;
    const uint64_t qcode = pack_bools(qg_bools + (bi * routes + ro) * kgroups, kgroups);
    const bool* kg = kg_bools + bi * nk * stride + ro * kgroups;
    idx.clear();
    if (qcode)
      for (int64_t j = lo, stop = std::min(hi, local_lo); j < stop; ++j)
        if ((rl == nullptr || rl[j]) && (pack_bools(kg + j * stride, kgroups) & qcode))
          idx.push_back(j);
    for (int64_t j = std::max(lo, local_lo); j < hi; ++j)
      if (rl == nullptr || rl[j]) idx.push_back(j);
  }

  // row idx[t] of rows(j) as fp32 (in place for float inputs, else converted into sc.row),
  // with the row kAhead further on prefetched
  template <typename Rows>
  const float* visible_row(DecodeScratch& sc, int64_t t, int64_t n, Rows rows) const {
    if (t + kAhead < n) prefetch_row(rows(sc.idx[t + kAhead]), d);
    const T* src = rows(sc.idx[t]);
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
      load_row(sc.row.data(), src, d);
      return sc.row.data();
    }
  }

  // the rep query rows' logits against the n keys idx[0..n), scaled, into sc.s (row r at r * n)
  void decode_logits(DecodeScratch& sc, int64_t bi, int64_t hk, int64_t n) const {
    const auto keys = [&](int64_t j) { return k_row(bi, hk, j); };
    for (int64_t t = 0; t < n; ++t) {
      const float* kr = visible_row(sc, t, n, keys);
      for (int64_t r = 0; r < rep; ++r) sc.s[r * n + t] = dot(sc.q.data() + r * d, kr, d) * scale;
    }
  }

  // acc[r] = sum_t p[r][t] * value[idx[t]] for the rep rows
  void decode_values(DecodeScratch& sc, int64_t bi, int64_t hk, int64_t n) const {
    std::fill(sc.acc.begin(), sc.acc.begin() + rep * d, 0.f);
    const auto values = [&](int64_t j) { return v_row(bi, hk, j); };
    for (int64_t t = 0; t < n; ++t) {
      const float* vr = visible_row(sc, t, n, values);
      for (int64_t r = 0; r < rep; ++r) {
        const float p = sc.s[r * n + t];
        float* a = sc.acc.data() + r * d;
        for (int64_t e = 0; e < d; ++e) a[e] += p * vr[e];
      }
    }
  }

  // one (batch, key head, segment) of a decoding step, into out / lse or the segment's partials
  void decode_item(DecodeScratch& sc, int64_t t) const {
    const int64_t seg = t % segments, hk = (t / segments) % hkv, bi = t / (segments * hkv);
    float* out_base = segments > 1 ? part_out.data() + seg * b * h * d : out;
    float* lse_base = segments > 1 ? part_lse.data() + seg * b * h : lse;
    const int64_t ro = routes > 1 ? hk : 0;
    const std::vector<int64_t>& keys = visible[(bi * routes + ro) * segments + seg];
    const int64_t n = static_cast<int64_t>(keys.size());
    sc.idx = keys.data();
    for (int64_t r = 0; r < rep; ++r) load_row(sc.q.data() + r * d, q_row(bi, hk * rep + r, 0), d);
    decode_logits(sc, bi, hk, n);
    float mx[64], sum[64];  // rep <= 64 (checked by the caller)
    for (int64_t r = 0; r < rep; ++r) {
      float* srow = sc.s.data() + r * n;
      mx[r] = n ? row_max(srow, n) : kNegInf;
      if (mx[r] == kNegInf) {  // nothing visible: P = 0
        std::fill(srow, srow + n, 0.f);
        sum[r] = 0.f;
      } else {
        sum[r] = exp_shift_sum(srow, n, mx[r]);
      }
    }
    decode_values(sc, bi, hk, n);
    for (int64_t r = 0; r < rep; ++r) {
      const int64_t head = hk * rep + r;
      write_normalised(out_base + (bi * h + head) * d, lse_base[bi * h + head],
                       sc.acc.data() + r * d, mx[r], sum[r], d);
    }
  }

  void run_decode() {
    plan_segments(b * hkv);
    const int64_t longest = (nk + segments - 1) / segments + 1;
    visible.assign(b * routes * segments, {});  // listed once, read by the heads of a route
    at::parallel_for(0, b * routes * segments, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t seg = t % segments, ro = (t / segments) % routes;
        const int64_t bi = t / (segments * routes);
        visible[t].reserve(static_cast<size_t>(longest));
        decode_keys(bi, ro, seg * nk / segments, (seg + 1) * nk / segments, visible[t]);
      }
    });
    pull<DecodeScratch>(
        b * hkv * segments, [&](DecodeScratch& sc) { sc.reserve(longest, rep, d); },
        [&](DecodeScratch& sc, int64_t t) { decode_item(sc, t); });
    if (segments > 1) {
      at::parallel_for(0, b * h, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t) merge_segments(t / h, 0, t % h);
      });
    }
  }

  // phase 1's items of key head hk of batch element bi: tiles of up to tile_q queries of
  // each class of its plan
  void add_group_items(std::vector<Item>& items, int64_t bi, int64_t hk) const {
    const Plan<C>& p = plan(bi, hk);
    const int64_t classes = static_cast<int64_t>(p.class_code.size());
    for (int64_t c = 0; c < classes; ++c) {
      const int64_t groups = __builtin_popcountll(static_cast<uint64_t>(p.class_code[c]));
      for (int64_t r0 = p.class_start[c]; r0 < p.class_start[c + 1]; r0 += tile_q) {
        const int64_t r1 = std::min(p.class_start[c + 1], r0 + tile_q);
        const double cost = static_cast<double>(r1 - r0) *
                            static_cast<double>(offset + p.class_rows[r1 - 1] + 1) * groups;
        items.push_back({bi, c, r0, r1, hk, cost, 0, 0, nk});
      }
    }
  }

  // plan_segments() for phase 1's items, then each item's keys split into its segments
  void split_into_segments(std::vector<Item>& items) {
    plan_segments(static_cast<int64_t>(items.size()));
    if (segments == 1) return;
    std::vector<Item> split;
    for (const Item& it : items)
      for (int64_t sg = 0; sg < segments; ++sg) {
        Item part = it;
        part.segment = sg;
        part.key_lo = sg * nk / segments;
        part.key_hi = (sg + 1) * nk / segments;
        part.cost = it.cost / static_cast<double>(segments);
        split.push_back(part);
      }
    items.swap(split);
  }

  // phase 1 by membership class: tiles of each class's queries, split into key segments
  // where they are too few for the threads
  void run_by_class() {
    std::vector<Item> items;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t hk = 0; hk < hkv; ++hk) add_group_items(items, bi, hk);
    split_into_segments(items);
    // costliest first: the pull order then balances the triangular workload
    std::sort(items.begin(), items.end(),
              [](const Item& x, const Item& y) { return x.cost > y.cost; });
    int64_t widest = 1;  // most class queries in one tile: the tile buffers' rows / rep
    for (const Item& it : items) widest = std::max(widest, it.row1 - it.row0);
    pull_tiles(static_cast<int64_t>(items.size()), rep * widest,
         [&](TileState& ts, int64_t t) { group_tile(ts, items[t]); });
    if (segments > 1) {
      at::parallel_for(0, b * nq, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t) {
          const int64_t bi = t / nq, qi = t % nq;
          for (int64_t head = 0; head < h; ++head)
            if (plan(bi, head / rep).qcode[qi] != 0)  // else no group part: phase 2 alone
              merge_segments(bi, qi, head);
        }
      });
    }
  }

  void run() {
    choose_by_group();
    if (by_group) {
      run_by_group();
      std::vector<GroupedKeys>().swap(grouped);
    } else {
      run_by_class();
    }
    const int64_t tiles = (nq + tile_band - 1) / tile_band;  // per batch element and head
    pull_tiles(b * tiles * hkv, rep * std::min(tile_band, nq), [&](TileState& ts, int64_t t) {
      const int64_t bi = t / (tiles * hkv), r0 = (t / hkv) % tiles * tile_band;
      band_tile(ts, Item{bi, 0, r0, std::min(nq, r0 + tile_band), t % hkv, 1.0});
    });
  }
};

// Whether t [B, H, N, D] has contiguous rows of D elements, one after the other along N (its
// batch and head strides may be larger: a prefix of a KV cache buffer).
bool rows_contiguous(const at::Tensor& t) {
  return t.dim() == 4 && (t.size(3) <= 1 || t.stride(3) == 1) &&
         (t.size(2) <= 1 || t.stride(2) == t.size(3));
}

// query [B, H, Nq, D] (contiguous), key/value [B, H_kv, Nk, D] (rows contiguous along Nk,
// any batch and head strides; same dtype), query_groups
// bool [B, Nq, K], key_groups bool [B, Nk, K] (K <= 64) shared by the heads, or both per key
// head, [B, Nq, H_kv, K] and [B, Nk, H_kv, K]; real bool [B, Nk] or empty;
// writes out fp32 [B, Nq, H, D] and lse fp32 [B, Nq, H].
void focus_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& query_groups, const at::Tensor& key_groups,
                   const at::Tensor& real, int64_t window, double scale, at::Tensor out,
                   at::Tensor lse, int64_t tile_q, int64_t tile_k, int64_t tile_band,
                   int64_t segment_keys) {
  TORCH_CHECK(query.is_contiguous() && rows_contiguous(key) && rows_contiguous(value),
              "focus_forward: query must be contiguous, key/value rows contiguous along Nk");
  TORCH_CHECK(query_groups.is_contiguous() && key_groups.is_contiguous(),
              "focus_forward: group masks must be contiguous");
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous() && out.scalar_type() == at::kFloat &&
                  lse.scalar_type() == at::kFloat,
              "focus_forward: out/lse must be contiguous float32");
  const int64_t routes = query_groups.dim() == 4 ? query_groups.size(2) : 1;
  TORCH_CHECK((query_groups.dim() == 3 || routes == key.size(1)) &&
                  key_groups.dim() == query_groups.dim(),
              "focus_forward: memberships [B, N, K], or [B, N, H_kv, K] on both sides");
  const int64_t kgroups = query_groups.size(-1);
  TORCH_CHECK(kgroups <= 64, "focus_forward: at most 64 groups");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "focus", [&] {
    auto launch = [&](auto code_type) {
      using C = decltype(code_type);
      Kernel<scalar_t, C> ker;
      ker.q = query.data_ptr<scalar_t>();
      ker.k = key.data_ptr<scalar_t>();
      ker.v = value.data_ptr<scalar_t>();
      ker.real = real.numel() ? real.data_ptr<bool>() : nullptr;
      ker.out = out.data_ptr<float>();
      ker.lse = lse.data_ptr<float>();
      ker.b = query.size(0);
      ker.h = query.size(1);
      ker.nq = query.size(2);
      ker.d = query.size(3);
      ker.hkv = key.size(1);
      ker.nk = key.size(2);
      ker.k_batch_stride = key.stride(0);
      ker.k_head_stride = key.stride(1);
      ker.v_batch_stride = value.stride(0);
      ker.v_head_stride = value.stride(1);
      ker.rep = ker.h / ker.hkv;
      ker.window = window;
      ker.offset = ker.nk - ker.nq;
      ker.scale = static_cast<float>(scale);
      ker.tile_q = tile_q;
      ker.tile_k = tile_k;
      ker.tile_band = tile_band;
      ker.segment_keys = segment_keys;
      ker.routes = routes;
      ker.kgroups = kgroups;
      const bool* qg = query_groups.data_ptr<bool>();
      const bool* kg = key_groups.data_ptr<bool>();
      if (ker.nq == 1 && ker.rep <= 64) {  // a decoding step: no classes to plan
        ker.qg_bools = qg;
        ker.kg_bools = kg;
        ker.run_decode();
        return;
      }
      const int64_t stride = routes * kgroups;  // between the tokens of one route
      for (int64_t bi = 0; bi < ker.b; ++bi)
        for (int64_t ro = 0; ro < routes; ++ro)
          ker.plans.push_back(make_plan<C>(
              qg + bi * ker.nq * stride + ro * kgroups, kg + bi * ker.nk * stride + ro * kgroups,
              ker.real ? ker.real + bi * ker.nk : nullptr, ker.nq, ker.nk, kgroups, stride));
      ker.run();
    };
    if (kgroups <= 8) {
      launch(uint8_t{});
    } else if (kgroups <= 16) {
      launch(uint16_t{});
    } else if (kgroups <= 32) {
      launch(uint32_t{});
    } else {
      launch(uint64_t{});
    }
  });
}

// ---- routing of a few tokens (a decoding step), spec sections 1 and 4: the causal top-k
// memberships of each token, top_k of
//   normalize(hidden @ proj) . normalize(centroids)^T / temperature + bias
// (unit vectors with the norm clamped below at 1e-6, as torch.nn.functional.normalize),
// in fp32, ties to the lowest group index. One call replaces a dozen small PyTorch calls.
// Returns whether a score was NaN (the caller raises).
template <typename T>
bool route_rows(const T* hidden, const float* proj, const float* centroids, const float* bias,
                int64_t rows, int64_t d_model, int64_t d_g, int64_t groups, double temperature,
                int64_t top_k, bool* out) {
  std::vector<float> unit(groups * d_g), feats(d_g), scores(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const float* c = centroids + g * d_g;
    float sq = 0.f;
    for (int64_t e = 0; e < d_g; ++e) sq += c[e] * c[e];
    const float denom = std::max(std::sqrt(sq), 1e-6f);
    for (int64_t e = 0; e < d_g; ++e) unit[g * d_g + e] = c[e] / denom;
  }
  const float tau = static_cast<float>(temperature);
  bool nan = false;
  for (int64_t r = 0; r < rows; ++r) {
    const T* h = hidden + r * d_model;
    std::fill(feats.begin(), feats.end(), 0.f);
    for (int64_t i = 0; i < d_model; ++i) {
      const float x = static_cast<float>(h[i]);
      const float* p = proj + i * d_g;
      for (int64_t e = 0; e < d_g; ++e) feats[e] += x * p[e];
    }
    float sq = 0.f;
    for (int64_t e = 0; e < d_g; ++e) sq += feats[e] * feats[e];
    const float denom = std::max(std::sqrt(sq), 1e-6f);
    for (int64_t e = 0; e < d_g; ++e) feats[e] /= denom;
    for (int64_t g = 0; g < groups; ++g) {
      float dotp = 0.f;
      for (int64_t e = 0; e < d_g; ++e) dotp += feats[e] * unit[g * d_g + e];
      scores[g] = dotp / tau + bias[g];
      nan = nan || std::isnan(scores[g]);
    }
    bool* o = out + r * groups;
    std::fill(o, o + groups, false);
    for (int64_t pick = 0; pick < top_k; ++pick) {  // the highest not yet taken, lowest index
      int64_t best = -1;
      for (int64_t g = 0; g < groups; ++g)
        if (!o[g] && (best < 0 || scores[g] > scores[best])) best = g;
      o[best] = true;
    }
  }
  return nan;
}

// memberships bool [B, N, K] of hidden [B, N, d_model] (contiguous; float, double, bf16 or
// half) with proj [d_model, d_g], centroids [K, d_g] and bias [K] (contiguous float32), and
// whether a score was NaN
std::tuple<at::Tensor, bool> focus_route(const at::Tensor& hidden, const at::Tensor& proj,
                                         const at::Tensor& centroids, const at::Tensor& bias,
                                         double temperature, int64_t top_k) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.is_contiguous(), "focus_route: contiguous [B, N, d]");
  TORCH_CHECK(proj.is_contiguous() && centroids.is_contiguous() && bias.is_contiguous() &&
                  proj.scalar_type() == at::kFloat && centroids.scalar_type() == at::kFloat &&
                  bias.scalar_type() == at::kFloat,
              "focus_route: contiguous float32 router tensors");
  const int64_t d_model = hidden.size(2), d_g = proj.size(1), groups = centroids.size(0);
  TORCH_CHECK(proj.size(0) == d_model && centroids.size(1) == d_g && bias.numel() == groups &&
                  top_k >= 1 && top_k <= groups,
              "focus_route: mismatched shapes or top_k");
  at::Tensor out = at::empty({hidden.size(0), hidden.size(1), groups},
                             hidden.options().dtype(at::kBool));
  bool nan = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "route", [&] {
    nan = route_rows(hidden.data_ptr<scalar_t>(), proj.data_ptr<float>(),
                     centroids.data_ptr<float>(), bias.data_ptr<float>(),
                     hidden.size(0) * hidden.size(1), d_model, d_g, groups, temperature, top_k,
                     out.data_ptr<bool>());
  });
  return {out, nan};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("focus_forward", &focus_forward, "Fused Focus sparse attention forward (CPU)");
  m.def("focus_route", &focus_route, "Causal top-k routing of a few tokens (CPU)");
}
