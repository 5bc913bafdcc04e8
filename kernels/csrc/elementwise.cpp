// Element-wise ops of a Llama layer, each one pass over memory: residual add
// fused into RMSNorm (the float32 residual updated in place), RoPE applied in
// place to the Q and K views of the QKV projection, SiLU(gate) * up, and the
// step's K and V rows copied into their cache slots.
// Arithmetic is float32; inputs and outputs are float32 or bf16.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "parallel.h"
#include "vec.h"

namespace sf {
namespace {

// Rows of x ([T, H], last dim contiguous) in parallel, 16 an item; fn(row index).
template <typename F>
void rows(int64_t n, F fn) {
  parallel_items((n + 15) / 16, [&](int64_t item, bool) {
    for (int64_t i = item * 16; i < std::min(n, item * 16 + 16); ++i) fn(i);
  });
}

template <typename X, typename Wt>
void norm_row(const float* r, const Wt* w, Wt* out, int64_t H, float eps) {
  vf ss{};
  for (int64_t i = 0; i < H; i += W) {
    vf x = load(r + i);
    ss += x * x;
  }
  const float inv = 1.f / std::sqrt(hsum(ss) / H + eps);
  for (int64_t i = 0; i < H; i += W) store(out + i, load(r + i) * inv * load(w + i));
}

template <typename X, typename Wt>
void add_rms_norm_impl(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
                       double eps, bool add) {
  const int64_t H = x.size(1);
  const X* xp = x.data_ptr<X>();
  float* rp = residual.data_ptr<float>();
  const Wt* wp = weight.data_ptr<Wt>();
  Wt* op = out.data_ptr<Wt>();
  const int64_t xs = x.stride(0);
  rows(x.size(0), [&](int64_t t) {
    float* r = rp + t * H;
    const X* xr = xp + t * xs;
    for (int64_t i = 0; i < H; i += W) store(r + i, add ? load(r + i) + load(xr + i) : load(xr + i));
    norm_row<X, Wt>(r, wp, op + t * H, H, static_cast<float>(eps));
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be 2-D with a contiguous last dim");
  TORCH_CHECK(x.size(1) % W == 0, name, ": hidden size must be a multiple of ", W);
}

// residual (float32, [T, H], contiguous) += x; returns rms_norm(residual) * weight in weight's dtype.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps, bool add) {
  check_rows(x, "x");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.sizes() == x.sizes(),
              "residual must be contiguous float32 shaped like x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden]");
  at::Tensor out = at::empty(x.sizes(), weight.options());
  const auto xt = x.scalar_type(), wt = weight.scalar_type();
  if (xt == at::kFloat && wt == at::kFloat) {
    add_rms_norm_impl<float, float>(x, residual, weight, out, eps, add);
  } else if (xt == at::kBFloat16 && wt == at::kBFloat16) {
    add_rms_norm_impl<c10::BFloat16, c10::BFloat16>(x, residual, weight, out, eps, add);
  } else if (xt == at::kFloat && wt == at::kBFloat16) {
    add_rms_norm_impl<float, c10::BFloat16>(x, residual, weight, out, eps, add);
  } else {
    TORCH_CHECK(false, "add_rms_norm: unsupported dtypes ", xt, "/", wt);
  }
  return out;
}

template <typename T>
void silu_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t F = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  rows(x.size(0), [&](int64_t t) {
    const T* g = xp + t * xs;
    for (int64_t i = 0; i < F; i += W) store(op + t * F + i, silu(load(g + i)) * load(g + F + i));
  });
}

// x = [gate | up] on the last dim; returns silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % (2 * W) == 0, "x: width must be a multiple of ", 2 * W);
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(x, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    silu_mul_impl<c10::BFloat16>(x, out);
  } else {
    TORCH_CHECK(false, "silu_mul: unsupported dtype ", x.scalar_type());
  }
  return out;
}

template <typename T>
void rope_heads(T* x, int64_t row_stride, int heads, int64_t t, const float* cs, int D) {
  const int half = D / 2;
  for (int h = 0; h < heads; ++h) {
    T* p = x + t * row_stride + h * D;
    for (int i = 0; i < half; i += W) {
      vf x1 = load(p + i), x2 = load(p + half + i);
      vf c = load(cs + i), s = load(cs + half + i);
      store(p + i, x1 * c - x2 * s);
      store(p + half + i, x2 * c + x1 * s);
    }
  }
}

template <typename T>
void rope_impl(at::Tensor& q, at::Tensor& k, const int64_t* pos, const float* cs, int64_t cs_stride) {
  const int D = q.size(2);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  rows(q.size(0), [&](int64_t t) {
    const float* c = cs + pos[t] * cs_stride;
    rope_heads(qp, q.stride(0), q.size(1), t, c, D);
    rope_heads(kp, k.stride(0), k.size(1), t, c, D);
  });
}

// Rotate-half RoPE in place on q [T, heads, D] and k [T, kv_heads, D] (rows may be strided).
void rope(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_sin) {
  const int64_t D = q.size(2);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(2) == D && q.size(0) == k.size(0), "q/k must be [T, heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && k.stride(2) == 1 && k.stride(1) == D,
              "q/k heads must be contiguous");
  TORCH_CHECK((D / 2) % W == 0, "rope: head_dim / 2 must be a multiple of ", W);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "positions must be contiguous int64 [T]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.stride(1) == 1 && cos_sin.size(1) == D,
              "cos_sin must be float32 [max_pos, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q/k dtype mismatch");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t t = 0; t < q.size(0); ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  if (q.scalar_type() == at::kFloat) {
    rope_impl<float>(q, k, pos, cos_sin.data_ptr<float>(), cos_sin.stride(0));
  } else if (q.scalar_type() == at::kBFloat16) {
    rope_impl<c10::BFloat16>(q, k, pos, cos_sin.data_ptr<float>(), cos_sin.stride(0));
  } else {
    TORCH_CHECK(false, "rope: unsupported dtype ", q.scalar_type());
  }
}

// k and v [T, kv_heads, D] (heads contiguous, rows may be strided: views of
// the QKV projection) into k_cache and v_cache (contiguous, [..., kv_heads, D]
// a slot) at slots [T]: one call for both caches, a row copy each. torch's
// index_copy_ took two calls of its machinery a layer, 5 % of a 32-stream
// decode step on the 2-core Xeon.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k/v must be [T, kv_heads, D]");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k/v heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.numel() % row == 0 && k_cache.size(-1) * k_cache.size(-2) == row,
              "caches must be contiguous, [..., kv_heads, D] a slot");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k/v dtype must be the cache's");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "slots must be contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.numel() / row;
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot out of range");
  const int64_t size = k.element_size();
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * size, vs = v.stride(0) * size, bytes = row * size;
  parallel_items((T + 255) / 256, [&](int64_t item, bool) {  // a decode's rows in one go, a prompt's in parallel
    for (int64_t t = item * 256; t < std::min(T, item * 256 + 256); ++t) {
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, bool add) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &sf::add_rms_norm);
  m.def("silu_mul(Tensor x) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &sf::silu_mul);
  m.def("rope(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin) -> ()");
  m.impl("rope", c10::DispatchKey::CPU, &sf::rope);
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &sf::write_kv);
}
