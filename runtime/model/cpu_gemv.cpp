#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// One-row bf16 products (GEMV) with aten's arithmetic, read at the memory's bandwidth: runtime/model/cpu_gemv.py.
//
// Legend: R rows, N out features, D in features (a multiple of 64), E experts.

// One row's dot product with the arithmetic of aten's bf16 dot on x86 (its AVX2 kernel: fp32 FMAs into eight 8-lane
// accumulators over 64-element chunks, the accumulators summed as a tree, then the 8-lane shuffle reduction), in
// 16-lane registers, with x already in fp32 (aten converts it again for every row: the work that bounds its speed).
static inline float dot_row(const float* x, const uint16_t* w, int64_t len) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 64) {
    __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + j))), 16));
    __m512 w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + j + 16))), 16));
    __m512 w2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + j + 32))), 16));
    __m512 w3 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + j + 48))), 16));
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), w0, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 16), w1, a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 32), w2, a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 48), w3, a3);
  }
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
      y[i] = c10::BFloat16(dot_row(xs[r], ws[r] + (i - r * N) * D, D));
    }
  });
}

// A contiguous bf16 tensor's values in fp32 (exact), converted without an aten operator.
static std::vector<float> to_float(const torch::Tensor& x) {
  const c10::BFloat16* p = x.data_ptr<c10::BFloat16>();
  std::vector<float> out(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) out[i] = static_cast<float>(p[i]);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows);
  m.def("grouped_rows", &grouped_rows);
  m.def("routed_rows", &routed_rows);
}
