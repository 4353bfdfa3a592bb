// The one extension module: Python lists of tensors + scalars in, the torch-free kernels of
// include/kernel_api.h called on the CPU (cpu/) or, when built WITH_CUDA, on the GPU (cuda/).
// Every argument is checked here (device, dtype, contiguity, sizes) before any tensor is touched,
// so a refused call leaves everything as it was.
#include "bindings_common.h"

#include <cstdint>
#include <cstring>

namespace {

using lo_bind::check_flat;
using lo_bind::dtype_of;
using lo_bind::exec_for;

using TensorList = std::vector<at::Tensor>;

// What the tensors of one list must be, relative to the params (list 0).
enum class Role { Param, Grad, F32, SameAsParam, Any16 };

struct ListSpec {
  const TensorList* tensors;
  const char* name;
  Role role;
};

// Packed pointer arrays of a call; owns the storage ListArgs points into.
struct Packed {
  lo::ListArgs args;
  lo::Types types;
  at::Device device = at::kCPU;
  std::vector<int64_t> numel;
  std::vector<void*> ptrs[lo::kMaxDepth];
};

Packed pack(const std::vector<ListSpec>& specs) {
  TORCH_CHECK(!specs.empty() && specs.size() <= static_cast<size_t>(lo::kMaxDepth), "pack: 1 to 8 lists");
  Packed out;
  const TensorList& params = *specs[0].tensors;
  const int64_t n = static_cast<int64_t>(params.size());
  out.numel.resize(n);
  if (n > 0) {
    out.device = params[0].device();
    out.types.p = dtype_of(params[0], specs[0].name);
  }
  bool grad_seen = false;
  for (size_t l = 0; l < specs.size(); ++l) {
    const ListSpec& s = specs[l];
    const TensorList& list = *s.tensors;
    if (list.empty() && l > 0) continue;  // an absent optional list
    TORCH_CHECK_VALUE(static_cast<int64_t>(list.size()) == n, s.name, ": expected ", n, " tensors, got ", list.size());
    out.ptrs[l].resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& t = list[i];
      TORCH_CHECK_VALUE(t.defined(), s.name, "[", i, "]: undefined tensor");
      TORCH_CHECK_VALUE(t.device() == out.device, s.name, "[", i, "]: on ", t.device(), ", expected ", out.device);
      TORCH_CHECK_VALUE(t.is_contiguous(), s.name, "[", i, "]: must be contiguous (use the torch backend for strided tensors)");
      if (l == 0) out.numel[i] = t.numel();
      else TORCH_CHECK_VALUE(t.numel() == out.numel[i], s.name, "[", i, "]: ", t.numel(), " elements, the param has ", out.numel[i]);
      lo::DType d = dtype_of(t, s.name);
      switch (s.role) {
        case Role::Param:
        case Role::SameAsParam:
          TORCH_CHECK_TYPE(d == out.types.p, s.name, "[", i, "]: dtype ", t.scalar_type(), " differs from the params'");
          break;
        case Role::F32:
          TORCH_CHECK_TYPE(d == lo::DType::F32, s.name, "[", i, "]: must be float32 (fp32 state), got ", t.scalar_type());
          break;
        case Role::Grad:
          TORCH_CHECK_TYPE(d == lo::DType::F32 || d == out.types.p, s.name, "[", i, "]: grads must be float32 or the params' dtype");
          if (!grad_seen) out.types.g = d;
          TORCH_CHECK_TYPE(d == out.types.g, s.name, "[", i, "]: all grads must share one dtype");
          grad_seen = true;
          break;
        case Role::Any16:
          TORCH_CHECK_TYPE(d != lo::DType::F32, s.name, "[", i, "]: must be bfloat16 or float16");
          if (i == 0) out.types.copy = d;
          TORCH_CHECK_TYPE(d == out.types.copy, s.name, "[", i, "]: all copies must share one dtype");
          out.types.has_copy = true;
          break;
      }
      out.ptrs[l][i] = t.data_ptr();
    }
    if (s.role == Role::SameAsParam) out.types.kahan = n > 0;
    out.args.ptr[l] = out.ptrs[l].data();
  }
  if (out.types.kahan) TORCH_CHECK_TYPE(out.types.p != lo::DType::F32, "kahan_comps: only for float16/bfloat16 params");
  out.args.n = n;
  out.args.numel = out.numel.data();
  return out;
}

bool is_cuda(const Packed& p) { return p.device.is_cuda(); }



lo::Decay decay_of(double keep, double neg_decay) {
  return lo::Decay{static_cast<float>(keep), static_cast<float>(neg_decay)};
}

// One float32 value per tensor, on the lists' device.
const float* per_tensor(const at::Tensor& t, const Packed& p, const char* name) {
  TORCH_CHECK_VALUE(t.device() == p.device && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == p.args.n,
                    name, ": expected a contiguous float32 tensor of ", p.args.n, " values on ", p.device);
  return t.data_ptr<float>();
}

at::Tensor sums_for(const Packed& p) {
  return at::zeros({p.args.n, 2}, at::TensorOptions().dtype(at::kDouble).device(p.device));
}

// ------------------------------------------------------------------ optimizers
void adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
          const TensorList& max_exp_avg_sqs, const TensorList& kahan_comps, const TensorList& param_copies, double w1,
          double beta2, double c2, double step, double sqrt_bc2, double eps, double l2, double keep, double neg_decay,
          bool apply) {
  TORCH_CHECK_VALUE(!exp_avgs.empty() || params.empty(), "exp_avgs: required");
  Packed p = pack({{&params, "params", Role::Param}, {&grads, "grads", Role::Grad}, {&exp_avgs, "exp_avgs", Role::F32},
                   {&exp_avg_sqs, "exp_avg_sqs", Role::F32}, {&max_exp_avg_sqs, "max_exp_avg_sqs", Role::F32},
                   {&kahan_comps, "kahan_comps", Role::SameAsParam}, {&param_copies, "param_copies", Role::Any16}});
  if (p.args.n == 0) return;
  TORCH_CHECK_VALUE(!exp_avg_sqs.empty(), "exp_avg_sqs: required");
  TORCH_CHECK_VALUE(!p.types.has_copy || p.types.p == lo::DType::F32, "param_copies: only for float32 (master) params");
  lo::AdamHyper h{float(w1), float(beta2), float(c2), float(step), float(sqrt_bc2), float(eps), float(l2), decay_of(keep, neg_decay)};
  LO_GUARD(p.device);
  LO_CALL(p, adam, exec_for(p.device), p.args, h, p.types, !max_exp_avg_sqs.empty(), apply, false);
}

// 1-bit Adam's compression-stage update: p <- p + step * m / (sqrt(v) / sqrt_bc2 + eps) with decoupled
// decay, m (fp32, final) and v (frozen) only read.
void adam_frozen(const TensorList& params, const TensorList& momenta, const TensorList& exp_avg_sqs,
                 const TensorList& kahan_comps, double step, double sqrt_bc2, double eps, double keep, double neg_decay) {
  const TensorList none;
  Packed p = pack({{&params, "params", Role::Param}, {&momenta, "momenta", Role::F32}, {&none, "exp_avgs", Role::F32},
                   {&exp_avg_sqs, "exp_avg_sqs", Role::F32}, {&none, "max_exp_avg_sqs", Role::F32},
                   {&kahan_comps, "kahan_comps", Role::SameAsParam}, {&none, "param_copies", Role::Any16}});
  if (p.args.n == 0) return;
  TORCH_CHECK_VALUE(momenta.size() == params.size(), "momenta: required, one per param");
  TORCH_CHECK_VALUE(exp_avg_sqs.size() == params.size(), "exp_avg_sqs: required, one per param");
  p.types.g = lo::DType::F32;
  lo::AdamHyper h{0.0f, 1.0f, 0.0f, float(step), float(sqrt_bc2), float(eps), 0.0f, decay_of(keep, neg_decay)};
  LO_GUARD(p.device);
  LO_CALL(p, adam, exec_for(p.device), p.args, h, p.types, false, true, true);
}

void sgd(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers, const TensorList& kahan_comps,
         double momentum, double damp_keep, double l2_pre, double l2_post, double neg_lr, bool first, bool nesterov,
         double keep, double neg_decay, bool apply) {
  Packed p = pack({{&params, "params", Role::Param}, {&grads, "grads", Role::Grad},
                   {&momentum_buffers, "momentum_buffers", Role::F32}, {&kahan_comps, "kahan_comps", Role::SameAsParam}});
  if (p.args.n == 0) return;
  TORCH_CHECK_VALUE(apply || !momentum_buffers.empty(), "apply=False needs momentum buffers to accumulate into");
  lo::SgdHyper h{float(momentum), float(damp_keep), float(l2_pre), float(l2_post), float(neg_lr), first, nesterov,
                 decay_of(keep, neg_decay)};
  LO_GUARD(p.device);
  LO_CALL(p, sgd, exec_for(p.device), p.args, h, p.types, !momentum_buffers.empty(), apply);
}

void lion(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs, const TensorList& kahan_comps,
          double w1, double w2, double neg_lr, double keep, double neg_decay, bool apply) {
  Packed p = pack({{&params, "params", Role::Param}, {&grads, "grads", Role::Grad}, {&exp_avgs, "exp_avgs", Role::F32},
                   {&kahan_comps, "kahan_comps", Role::SameAsParam}});
  if (p.args.n == 0) return;
  TORCH_CHECK_VALUE(!exp_avgs.empty(), "exp_avgs: required");
  lo::LionHyper h{float(w1), float(w2), float(neg_lr), decay_of(keep, neg_decay)};
  LO_GUARD(p.device);
  LO_CALL(p, lion, exec_for(p.device), p.args, h, p.types, apply);
}

void adan(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs, const TensorList& exp_avg_diffs,
          const TensorList& exp_avg_sqs, const TensorList& prev_grads, const TensorList& kahan_comps, double w1, double w2,
          double beta2, double beta3, double c3, double bc1, double n_coef, double sqrt_bc3, double eps, double step,
          bool first, double keep, double neg_decay, bool apply) {
  Packed p = pack({{&params, "params", Role::Param}, {&grads, "grads", Role::Grad}, {&exp_avgs, "exp_avgs", Role::F32},
                   {&exp_avg_diffs, "exp_avg_diffs", Role::F32}, {&exp_avg_sqs, "exp_avg_sqs", Role::F32},
                   {&prev_grads, "prev_grads", Role::F32}, {&kahan_comps, "kahan_comps", Role::SameAsParam}});
  if (p.args.n == 0) return;
  TORCH_CHECK_VALUE(!exp_avgs.empty() && !exp_avg_diffs.empty() && !exp_avg_sqs.empty() && !prev_grads.empty(),
                    "adan: exp_avgs, exp_avg_diffs, exp_avg_sqs and prev_grads are required");
  lo::AdanHyper h{float(w1), float(w2), float(beta2), float(beta3), float(c3), float(bc1), float(n_coef), float(sqrt_bc3),
                  float(eps), float(step), first, decay_of(keep, neg_decay)};
  LO_GUARD(p.device);
  LO_CALL(p, adan, exec_for(p.device), p.args, h, p.types, apply);
}

lo::LambHyper lamb_hyper(double clip_div, double l2, double beta1, double m_coef, double beta2, double c2, double bc1,
                         double bc2, double eps, double wd, bool eps_inside_sqrt) {
  return lo::LambHyper{float(clip_div), float(l2), float(beta1), float(m_coef), float(beta2), float(c2), float(bc1),
                       float(bc2), float(eps), float(wd), eps_inside_sqrt, nullptr};
}

at::Tensor lamb_moments(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                        const TensorList& exp_avg_sqs, double clip_div, double l2, double beta1, double m_coef,
                        double beta2, double c2, double bc1, double bc2, double eps, double wd, bool eps_inside_sqrt,
                        bool norms) {
  Packed p = pack({{&params, "params", Role::Param}, {&grads, "grads", Role::Grad}, {&exp_avgs, "exp_avgs", Role::F32},
                   {&exp_avg_sqs, "exp_avg_sqs", Role::F32}});
  at::Tensor out = sums_for(p);
  if (p.args.n == 0) return out;
  TORCH_CHECK_VALUE(!exp_avgs.empty() && !exp_avg_sqs.empty(), "lamb: exp_avgs and exp_avg_sqs are required");
  LO_GUARD(p.device);
  LO_CALL(p, lamb_moments, exec_for(p.device), p.args,
          lamb_hyper(clip_div, l2, beta1, m_coef, beta2, c2, bc1, bc2, eps, wd, eps_inside_sqrt), p.types, norms,
          out.data_ptr<double>());
  return out;
}

void lamb_apply(const TensorList& params, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                const TensorList& kahan_comps, const at::Tensor& scales, double bc1, double bc2, double eps, double wd,
                bool eps_inside_sqrt) {
  Packed p = pack({{&params, "params", Role::Param}, {&exp_avgs, "exp_avgs", Role::F32},
                   {&exp_avg_sqs, "exp_avg_sqs", Role::F32}, {&kahan_comps, "kahan_comps", Role::SameAsParam}});
  if (p.args.n == 0) return;
  lo::LambHyper h = lamb_hyper(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, bc1, bc2, eps, wd, eps_inside_sqrt);
  h.scale = per_tensor(scales, p, "scales");
  LO_GUARD(p.device);
  LO_CALL(p, lamb_apply, exec_for(p.device), p.args, h, p.types);
}

at::Tensor lars_norms(const TensorList& params, const TensorList& grads) {
  Packed p = pack({{&params, "params", Role::Param}, {&grads, "grads", Role::Grad}});
  at::Tensor out = sums_for(p);
  if (p.args.n == 0) return out;
  LO_GUARD(p.device);
  LO_CALL(p, lars_norms, exec_for(p.device), p.args, p.types, out.data_ptr<double>());
  return out;
}

void lars(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
          const TensorList& kahan_comps, const std::optional<at::Tensor>& scales, double wd, double lo_clip,
          double hi_clip, double momentum, bool first, bool apply) {
  Packed p = pack({{&params, "params", Role::Param}, {&grads, "grads", Role::Grad},
                   {&momentum_buffers, "momentum_buffers", Role::F32}, {&kahan_comps, "kahan_comps", Role::SameAsParam}});
  if (p.args.n == 0) return;
  TORCH_CHECK_VALUE(apply || !momentum_buffers.empty(), "apply=False needs momentum buffers to accumulate into");
  lo::LarsHyper h{float(wd), float(lo_clip), float(hi_clip), float(momentum), first, nullptr};
  if (apply) {
    TORCH_CHECK_VALUE(scales.has_value(), "scales: required when apply=True");
    h.scale = per_tensor(*scales, p, "scales");
  }
  LO_GUARD(p.device);
  LO_CALL(p, lars, exec_for(p.device), p.args, h, p.types, !momentum_buffers.empty(), apply);
}

at::Tensor stable_moments(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                          const TensorList& exp_avg_sqs, double w1, double beta2, double c2, double bc2, double eps_sq,
                          bool rms) {
  Packed p = pack({{&params, "params", Role::Param}, {&grads, "grads", Role::Grad}, {&exp_avgs, "exp_avgs", Role::F32},
                   {&exp_avg_sqs, "exp_avg_sqs", Role::F32}});
  at::Tensor out = sums_for(p);
  if (p.args.n == 0) return out;
  TORCH_CHECK_VALUE(!exp_avgs.empty() && !exp_avg_sqs.empty(), "stable_adamw: exp_avgs and exp_avg_sqs are required");
  lo::StableHyper h{float(w1), float(beta2), float(c2), float(bc2), 0.0f, float(eps_sq), nullptr, nullptr, nullptr};
  LO_GUARD(p.device);
  LO_CALL(p, stable_moments, exec_for(p.device), p.args, h, p.types, rms, out.data_ptr<double>());
  return out;
}

void stable_apply(const TensorList& params, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                  const TensorList& kahan_comps, const at::Tensor& scales, const at::Tensor& keeps,
                  const at::Tensor& neg_decays, double bc2, double eps) {
  Packed p = pack({{&params, "params", Role::Param}, {&exp_avgs, "exp_avgs", Role::F32},
                   {&exp_avg_sqs, "exp_avg_sqs", Role::F32}, {&kahan_comps, "kahan_comps", Role::SameAsParam}});
  if (p.args.n == 0) return;
  lo::StableHyper h{0.0f, 0.0f, 0.0f, float(bc2), float(eps), 0.0f, per_tensor(scales, p, "scales"),
                    per_tensor(keeps, p, "keeps"), per_tensor(neg_decays, p, "neg_decays")};
  LO_GUARD(p.device);
  LO_CALL(p, stable_apply, exec_for(p.device), p.args, h, p.types);
}

// Benchmarks: the memory roof of this machine for an in-place 4-read/3-write fp32 pass.
void cpu_roof(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor& d) {
  for (const at::Tensor* t : {&a, &b, &c, &d}) {
    check_flat(*t, "cpu_roof", at::kFloat, at::Device(at::kCPU));
    TORCH_CHECK_VALUE(t->numel() == a.numel(), "cpu_roof: tensors of one size");
  }
  lo::cpu::roof(exec_for(a.device()), a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), d.data_ptr<float>(),
                a.numel());
}

// True when every tensor of both lists is contiguous (one call instead of one per tensor from Python).
bool all_contiguous(const TensorList& a, const TensorList& b) {
  for (const TensorList* list : {&a, &b})
    for (const at::Tensor& t : *list)
      if (!t.is_contiguous()) return false;
  return true;
}

// p.grad of every param of a group in one pass. Read from Python, each costs ~0.4 us
// once the previous step's stream has evicted the caches (0.8 ms for 2000 params); here the loads of
// consecutive params overlap. Returns (the params that have a grad, their grads, whether all of both are
// dense and contiguous), or None when a param is not exactly a Tensor or Parameter (a subclass may
// define .grad itself: Python reads it then).
py::object grads_of(const py::list& params) {
  PyObject* list = params.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  py::list with_grad, grads;
  bool contiguous = true;
  // Each param is a chain of dependent loads (PyObject -> TensorImpl -> AutogradMeta -> the grad's
  // TensorImpl), cold after a step's stream: walk the chain a few params ahead, one link per stage.
  auto impl_at = [&](Py_ssize_t j) -> c10::TensorImpl* {
    PyObject* o = PyList_GET_ITEM(list, j);
    return THPVariable_CheckExact(o) ? THPVariable_Unpack(o).unsafeGetTensorImpl() : nullptr;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
#if defined(__GNUC__)
    if (i + 12 < n) __builtin_prefetch(PyList_GET_ITEM(list, i + 12));
    if (i + 8 < n)
      if (c10::TensorImpl* impl = impl_at(i + 8)) __builtin_prefetch(impl);
    if (i + 4 < n)
      if (c10::TensorImpl* impl = impl_at(i + 4))
        if (c10::AutogradMetaInterface* meta = impl->autograd_meta()) __builtin_prefetch(meta);
    if (i + 2 < n)
      if (c10::TensorImpl* impl = impl_at(i + 2))
        if (c10::AutogradMetaInterface* meta = impl->autograd_meta())
          if (c10::TensorImpl* grad_impl = meta->grad().unsafeGetTensorImpl()) __builtin_prefetch(grad_impl);
#endif
    PyObject* obj = PyList_GET_ITEM(list, i);
    if (!THPVariable_CheckExact(obj)) return py::none();
    const at::Tensor& param = THPVariable_Unpack(obj);
    const at::TensorBase& grad = param.grad();
    if (!grad.defined()) continue;
    contiguous = contiguous && param.is_contiguous() && grad.layout() == at::kStrided && grad.is_contiguous();
    PyObject* wrapped = THPVariable_Wrap(grad);
    if (wrapped == nullptr) throw py::error_already_set();
    with_grad.append(py::handle(obj));
    grads.append(py::reinterpret_steal<py::object>(wrapped));
  }
  return py::make_tuple(with_grad, grads, contiguous);
}

// The data pointers of a list of tensors as one bytes object (8 bytes each), or None when an element is
// not exactly a Tensor or Parameter. Two of them compare in one memcmp: the coalescing cache checks that
// no param moved (p.data = ...) without one Python call per tensor.
py::object data_ptrs(const py::list& tensors) {
  PyObject* list = tensors.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  std::string out(static_cast<size_t>(n) * sizeof(std::uintptr_t), '\0');
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(list, i);
    if (!THPVariable_CheckExact(obj)) return py::none();
    const auto ptr = reinterpret_cast<std::uintptr_t>(THPVariable_Unpack(obj).data_ptr());
    std::memcpy(&out[static_cast<size_t>(i) * sizeof(ptr)], &ptr, sizeof(ptr));
  }
  return py::bytes(out);
}

// True when two lists hold the same objects in the same order (identity, not ==: tensors compare
// elementwise). One pointer comparison per item instead of one Python call.
bool same_items(const py::list& a, const py::list& b) {
  const Py_ssize_t n = PyList_GET_SIZE(a.ptr());
  if (PyList_GET_SIZE(b.ptr()) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i)
    if (PyList_GET_ITEM(a.ptr(), i) != PyList_GET_ITEM(b.ptr(), i)) return false;
  return true;
}

bool with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

// Every argument is named: the Python wrappers (lightning_optim/ops/fused.py) pass them by keyword,
// so a swapped pair of scalars is an error, not a silently different update.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pybind11::literals;
  m.doc() = "lightning-optim fused optimizer and 1-bit kernels (CPU, and CUDA when built with it)";
  m.def("with_cuda", &with_cuda);
  m.def("cpu_roof", &cpu_roof, "a"_a, "b"_a, "c"_a, "d"_a);
  m.def("all_contiguous", &all_contiguous, "a"_a, "b"_a);
  m.def("grads_of", &grads_of, "params"_a);
  m.def("data_ptrs", &data_ptrs, "tensors"_a);
  m.def("same_items", &same_items, "a"_a, "b"_a);
  m.def("adam", &adam, "params"_a, "grads"_a, "exp_avgs"_a, "exp_avg_sqs"_a, "max_exp_avg_sqs"_a,
        "kahan_comps"_a, "param_copies"_a, "w1"_a, "beta2"_a, "c2"_a, "step"_a, "sqrt_bc2"_a, "eps"_a,
        "l2"_a, "keep"_a, "neg_decay"_a, "apply"_a);
  m.def("adam_frozen", &adam_frozen, "params"_a, "momenta"_a, "exp_avg_sqs"_a, "kahan_comps"_a, "step"_a,
        "sqrt_bc2"_a, "eps"_a, "keep"_a, "neg_decay"_a);
  m.def("sgd", &sgd, "params"_a, "grads"_a, "momentum_buffers"_a, "kahan_comps"_a, "momentum"_a,
        "damp_keep"_a, "l2_pre"_a, "l2_post"_a, "neg_lr"_a, "first"_a, "nesterov"_a, "keep"_a,
        "neg_decay"_a, "apply"_a);
  m.def("lion", &lion, "params"_a, "grads"_a, "exp_avgs"_a, "kahan_comps"_a, "w1"_a, "w2"_a, "neg_lr"_a,
        "keep"_a, "neg_decay"_a, "apply"_a);
  m.def("adan", &adan, "params"_a, "grads"_a, "exp_avgs"_a, "exp_avg_diffs"_a, "exp_avg_sqs"_a,
        "prev_grads"_a, "kahan_comps"_a, "w1"_a, "w2"_a, "beta2"_a, "beta3"_a, "c3"_a, "bc1"_a, "n_coef"_a,
        "sqrt_bc3"_a, "eps"_a, "step"_a, "first"_a, "keep"_a, "neg_decay"_a, "apply"_a);
  m.def("lamb_moments", &lamb_moments, "params"_a, "grads"_a, "exp_avgs"_a, "exp_avg_sqs"_a, "clip_div"_a,
        "l2"_a, "beta1"_a, "m_coef"_a, "beta2"_a, "c2"_a, "bc1"_a, "bc2"_a, "eps"_a, "wd"_a,
        "eps_inside_sqrt"_a, "norms"_a);
  m.def("lamb_apply", &lamb_apply, "params"_a, "exp_avgs"_a, "exp_avg_sqs"_a, "kahan_comps"_a, "scales"_a,
        "bc1"_a, "bc2"_a, "eps"_a, "wd"_a, "eps_inside_sqrt"_a);
  m.def("lars_norms", &lars_norms, "params"_a, "grads"_a);
  m.def("lars", &lars, "params"_a, "grads"_a, "momentum_buffers"_a, "kahan_comps"_a, "scales"_a, "wd"_a,
        "lo_clip"_a, "hi_clip"_a, "momentum"_a, "first"_a, "apply"_a);
  m.def("stable_moments", &stable_moments, "params"_a, "grads"_a, "exp_avgs"_a, "exp_avg_sqs"_a, "w1"_a,
        "beta2"_a, "c2"_a, "bc2"_a, "eps_sq"_a, "rms"_a);
  m.def("stable_apply", &stable_apply, "params"_a, "exp_avgs"_a, "exp_avg_sqs"_a, "kahan_comps"_a,
        "scales"_a, "keeps"_a, "neg_decays"_a, "bc2"_a, "eps"_a);
  lo_bind::register_onebit(m);
}

