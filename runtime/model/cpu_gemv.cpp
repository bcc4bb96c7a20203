#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// One-row bf16 products (GEMV) with aten's arithmetic, read at the memory's bandwidth: runtime/model/cpu_gemv.py.
//
// Legend: R rows, N out features, D in features (a multiple of 64), E experts.

// 32 bf16 values from w: one 64-byte load where w is 64-byte aligned, else two 32-byte loads (a mapped file's tensors
// may sit 32 bytes off a cache line, where one 64-byte load would straddle two lines).
template <bool kAligned>
static inline __m512i load32(const uint16_t* w) {
  if (kAligned) return _mm512_load_si512((const void*)w);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)w)),
                            _mm256_loadu_si256((const __m256i*)(w + 16)), 1);
}

// One row's dot product with the arithmetic of aten's bf16 dot on x86 (its AVX2 kernel: fp32 FMAs into eight 8-lane
// accumulators over 64-element chunks, the accumulators summed as a tree, then the 8-lane shuffle reduction), in
// 16-lane registers, with x already in fp32 (aten converts it again for every row: the work that bounds its speed).
// Each chunk position keeps its own fp32 accumulator lane, but the lanes are laid out even/odd (a 32-bit word of two
// bf16 values gives the even one by a shift and the odd one by a mask: two instructions per 32 values where widening
// takes four); x comes in that layout (`to_float`), and the lanes are put back in order before the tree, so every
// sum is the one in chunk order.
template <bool kAligned>
static inline float dot_row(const float* x, const uint16_t* w, int64_t len) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps(), p2 = _mm512_setzero_ps(), p3 = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 64) {
    __m512i v0 = load32<kAligned>(w + j);
    __m512i v1 = load32<kAligned>(w + j + 32);
    p0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), p0);
    p1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 16), _mm512_castsi512_ps(_mm512_and_si512(v0, high)), p1);
    p2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 32), _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), p2);
    p3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 48), _mm512_castsi512_ps(_mm512_and_si512(v1, high)), p3);
  }
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  __m512 a0 = _mm512_permutex2var_ps(p0, lo, p1), a1 = _mm512_permutex2var_ps(p0, hi, p1);
  __m512 a2 = _mm512_permutex2var_ps(p2, lo, p3), a3 = _mm512_permutex2var_ps(p2, hi, p3);
  a0 = _mm512_add_ps(a0, a2);
  a1 = _mm512_add_ps(a1, a3);
  a0 = _mm512_add_ps(a0, a1);
  __m256 v = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x1));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

// y[r, n] = bf16(dot(xs[r], ws[r][n])): each output its own dot product, split over the intra-op threads.
static void rows(const float* const* xs, const uint16_t* const* ws, int64_t R, int64_t N, int64_t D,
                 c10::BFloat16* y) {
  at::parallel_for(0, R * N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t r = i / N;
      const uint16_t* w = ws[r] + (i - r * N) * D;
      y[i] = c10::BFloat16(reinterpret_cast<uintptr_t>(w) % 64 == 0 ? dot_row<true>(xs[r], w, D)
                                                                    : dot_row<false>(xs[r], w, D));
    }
  });
}

// A contiguous bf16 tensor's values in fp32 (exact), without an aten operator, in `dot_row`'s layout: in each block
// of 32, the 16 even positions, then the 16 odd ones.
static std::vector<float> to_float(const torch::Tensor& x) {
  const c10::BFloat16* p = x.data_ptr<c10::BFloat16>();
  std::vector<float> out(x.numel());
  for (int64_t b = 0; b < x.numel(); b += 32)
    for (int64_t l = 0; l < 16; ++l) {
      out[b + l] = static_cast<float>(p[b + 2 * l]);
      out[b + 16 + l] = static_cast<float>(p[b + 2 * l + 1]);
    }
  return out;
}

// Row r of x (x's one row for every r when it has one) times ws[r] ([N, D] each) -> bf16 y of `sizes`.
static torch::Tensor products(const torch::Tensor& x, const std::vector<const uint16_t*>& ws, int64_t N, int64_t D,
                              at::IntArrayRef sizes) {
  int64_t R = ws.size();
  auto xf = to_float(x);
  std::vector<const float*> xs(R);
  for (int64_t r = 0; r < R; ++r) xs[r] = xf.data() + (x.numel() == D ? 0 : r * D);
  auto y = torch::empty(sizes, x.options());
  rows(xs.data(), ws.data(), R, N, D, y.data_ptr<c10::BFloat16>());
  return y;
}

// x [..., D] (R rows) times w [N, D] -> [..., N].
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) {
  int64_t N = w.size(0), D = w.size(1);
  auto sizes = x.sizes().vec(); sizes.back() = N;
  return products(x, std::vector<const uint16_t*>(x.numel() / D, reinterpret_cast<const uint16_t*>(w.data_ptr())),
                  N, D, sizes);
}

// x [R, D] sorted by expert (offs [E]: each expert's end row, int32) times w [E, N, D] -> [R, N].
torch::Tensor grouped_rows(torch::Tensor x, torch::Tensor w, torch::Tensor offs) {
  int64_t E = w.size(0), N = w.size(1), D = w.size(2), R = x.size(0);
  const int32_t* o = offs.data_ptr<int32_t>();
  if (E == 0 || o[E - 1] != R) return at::_grouped_mm(x, w.transpose(-2, -1), offs);
  const uint16_t* base = reinterpret_cast<const uint16_t*>(w.data_ptr());
  std::vector<const uint16_t*> ws(R);
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (o[e] - start > 1) return at::_grouped_mm(x, w.transpose(-2, -1), offs);  // a product of several rows: a GEMM
    for (int64_t r = start; r < o[e]; ++r) ws[r] = base + e * N * D;
    start = o[e];
  }
  return products(x, ws, N, D, {R, N});
}

// Row k: x[k] (x's one row for every k when it has one) times expert ids[k]'s matrix of w [E, N, D] -> [K, N]; the
// ids are read here, on the host that is the device (one token's routed experts: K distinct one-row products).
torch::Tensor routed_rows(torch::Tensor x, torch::Tensor w, torch::Tensor ids) {
  int64_t N = w.size(1), D = w.size(2), K = ids.numel();
  const int64_t* e = ids.data_ptr<int64_t>();
  const uint16_t* base = reinterpret_cast<const uint16_t*>(w.data_ptr());
  std::vector<const uint16_t*> ws(K);
  for (int64_t k = 0; k < K; ++k) {
    TORCH_CHECK(e[k] >= 0 && e[k] < w.size(0), "routed_rows: expert id out of range");
    ws[k] = base + e[k] * N * D;
  }
  return products(x, ws, N, D, {K, N});
}

// Row k: x[k] (x's one row for every k when it has one) times ws[k] ([N, D] each, wherever each lies: a streamed
// layer's experts are views of a mapped file) -> [K, N]: one token's routed experts in one call.
torch::Tensor list_rows(torch::Tensor x, std::vector<torch::Tensor> ws) {
  int64_t K = ws.size(), N = ws[0].size(0), D = ws[0].size(1);
  std::vector<const uint16_t*> ptrs(K);
  for (int64_t k = 0; k < K; ++k) {
    TORCH_CHECK(ws[k].size(0) == N && ws[k].size(1) == D, "list_rows: every weight is [N, D]");
    ptrs[k] = reinterpret_cast<const uint16_t*>(ws[k].data_ptr());
  }
  return products(x, ptrs, N, D, {K, N});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows);
  m.def("grouped_rows", &grouped_rows);
  m.def("routed_rows", &routed_rows);
  m.def("list_rows", &list_rows);
}
