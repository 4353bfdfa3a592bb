// The 1-bit compression bindings: the sign table unpacking (comm/packing.py) and the per-piece passes
// of the compressed allreduce (one scale per piece, lightning_optim/comm/pieces.py). Every argument is
// checked before any tensor is touched.
#include "bindings_common.h"

namespace lo_bind {
namespace {

// ------------------------------------------------------------------ 1-bit

void check_packed(const at::Tensor& packed, int64_t n, const at::Device& device) {
  check_flat(packed, "packed", at::kByte, device);
  TORCH_CHECK_VALUE(packed.numel() == (n + 7) / 8, "packed: expected ", (n + 7) / 8, " bytes for ", n, " values, got ",
                    packed.numel());
}

void onebit_unpack_table(const at::Tensor& packed, const at::Tensor& table, const at::Tensor& out) {
  const at::Device device = out.device();
  TORCH_CHECK_VALUE(out.is_contiguous(), "out: must be contiguous");
  lo::DType type = dtype_of(out, "out");
  check_flat(table, "table", out.scalar_type(), device);
  TORCH_CHECK_VALUE(table.numel() == 256 * 8, "table: expected 256 x 8 values, got ", table.numel());
  check_packed(packed, out.numel(), device);
  if (out.numel() == 0) return;
  LO_GUARD(device);
  LO_CALL_DEV(device, onebit_unpack_table, exec_for(device), packed.data_ptr<uint8_t>(), type, table.data_ptr(),
              out.data_ptr(), out.numel());
}

// ------------------------------------------------------------------ 1-bit over pieces (per-tensor scales)
// `pieces` is an int64 [3, P] tensor (rows: pos, off, len) on the data's device; see lo::Pieces.
lo::Pieces pieces_of(const at::Tensor& table, int64_t total, const at::Device& device) {
  check_flat(table, "pieces", at::kLong, device);
  TORCH_CHECK_VALUE(table.dim() == 2 && table.size(0) == 3, "pieces: expected an int64 [3, P] tensor");
  TORCH_CHECK_VALUE(total >= 0 && total % 8 == 0, "total: must be a multiple of 8, got ", total);
  lo::Pieces pc;
  pc.n = table.size(1);
  pc.total = total;
  pc.pos = table.data_ptr<int64_t>();
  pc.off = pc.pos + pc.n;
  pc.len = pc.off + pc.n;
  if (!device.is_cuda()) {  // host tables are cheap to check: sorted, byte-aligned, inside the space
    int64_t end = 0;
    for (int64_t p = 0; p < pc.n; ++p) {
      TORCH_CHECK_VALUE(pc.pos[p] % 8 == 0 && pc.pos[p] >= end && pc.len[p] >= 0 && pc.off[p] >= 0 &&
                            pc.pos[p] + pc.len[p] <= total,
                        "pieces: piece ", p, " (pos ", pc.pos[p], ", len ", pc.len[p],
                        ") is not byte-aligned, sorted and inside the ", total, "-element space");
      end = pc.pos[p] + pc.len[p];
    }
  }
  return pc;
}

int64_t pieces_off_end(const at::Tensor& table) {  // the largest off + len (host tables only)
  if (table.is_cuda() || table.size(1) == 0) return 0;
  return (table[1] + table[2]).max().item<int64_t>();
}

void check_pieces_fit(const at::Tensor& table, const at::Tensor& values, const char* name) {
  TORCH_CHECK_VALUE(pieces_off_end(table) <= values.numel(), name, ": ", values.numel(),
                    " elements, the pieces reach ", pieces_off_end(table));
}

at::Tensor piece_sums_tensor(const lo::Pieces& pc, const at::Device& device) {
  return at::zeros({pc.n}, at::TensorOptions().dtype(at::kDouble).device(device));
}

// Per piece: sum of (x[off + j] + err[pos + j])^2 (err None: of x alone), as float64 [P].
at::Tensor onebit_seg_sumsq(const at::Tensor& x, const std::optional<at::Tensor>& err, const at::Tensor& pieces,
                            int64_t total) {
  const at::Device device = x.device();
  check_flat(x, "x", at::kFloat, device);
  lo::Pieces pc = pieces_of(pieces, total, device);
  check_pieces_fit(pieces, x, "x");
  const float* e = nullptr;
  if (err.has_value()) {
    check_flat(*err, "err", at::kFloat, device);
    TORCH_CHECK_VALUE(err->numel() >= total, "err: ", err->numel(), " elements, expected >= ", total);
    e = err->data_ptr<float>();
  }
  at::Tensor out = piece_sums_tensor(pc, device);
  if (pc.n == 0) return out;
  LO_GUARD(device);
  LO_CALL_DEV(device, onebit_seg_sumsq, exec_for(device), x.data_ptr<float>(), e, pc, out.data_ptr<double>());
  return out;
}

// 1-bit Adam's worker prologue in one pass (CPU): per piece p, x[off + j] <- lerp(x[off + j], grads[p][j], w1)
// (torch's lerp), then the sum of (x[off + j] + err[pos + j])^2 per piece, as float64 [P].
at::Tensor onebit_momentum_sumsq(const at::Tensor& x, const std::vector<at::Tensor>& grads, const at::Tensor& err,
                                 const at::Tensor& pieces, int64_t total, double w1) {
  const at::Device device = x.device();
  TORCH_CHECK_VALUE(device.is_cpu(), "onebit_momentum_sumsq: CPU tensors only, got ", device,
                    " (elsewhere: lerp the momentum, then onebit_seg_sumsq)");
  check_flat(x, "x", at::kFloat, device);
  lo::Pieces pc = pieces_of(pieces, total, device);
  check_pieces_fit(pieces, x, "x");
  check_flat(err, "err", at::kFloat, device);
  TORCH_CHECK_VALUE(err.numel() >= total, "err: ", err.numel(), " elements, expected >= ", total);
  TORCH_CHECK_VALUE(static_cast<int64_t>(grads.size()) == pc.n, "grads: ", grads.size(), " tensors for ", pc.n,
                    " pieces");
  std::vector<const float*> ptrs(grads.size());
  for (int64_t p = 0; p < pc.n; ++p) {
    const std::string name = "grads[" + std::to_string(p) + "]";
    check_flat(grads[p], name.c_str(), at::kFloat, device);
    TORCH_CHECK_VALUE(grads[p].numel() == pc.len[p], name, ": ", grads[p].numel(), " elements, its piece has ",
                      pc.len[p]);
    ptrs[p] = grads[p].data_ptr<float>();
  }
  at::Tensor out = piece_sums_tensor(pc, device);
  if (pc.n == 0) return out;
  lo::cpu::onebit_momentum_sumsq(exec_for(device), x.data_ptr<float>(), ptrs.data(), static_cast<float>(w1),
                                 err.data_ptr<float>(), pc, out.data_ptr<double>());
  return out;
}

// Signs of z = x[off + j] (+ err[pos + j] when add_err) into bit pos + j of packed, and (err given)
// err[pos + j] <- z - scales[p] sign(z). Bits of positions outside the pieces are left as they are.
void onebit_seg_compress(const at::Tensor& x, const std::optional<at::Tensor>& err, const at::Tensor& packed,
                         const at::Tensor& pieces, int64_t total, const at::Tensor& scales, bool add_err) {
  const at::Device device = x.device();
  check_flat(x, "x", at::kFloat, device);
  lo::Pieces pc = pieces_of(pieces, total, device);
  check_pieces_fit(pieces, x, "x");
  check_flat(packed, "packed", at::kByte, device);
  TORCH_CHECK_VALUE(packed.numel() * 8 >= total, "packed: ", packed.numel(), " bytes, expected >= ", total / 8);
  check_flat(scales, "scales", at::kFloat, device);
  TORCH_CHECK_VALUE(scales.numel() == pc.n, "scales: ", scales.numel(), " values for ", pc.n, " pieces");
  TORCH_CHECK_VALUE(err.has_value() || !add_err, "err: needed when add_err");
  float* e = nullptr;
  if (err.has_value()) {
    check_flat(*err, "err", at::kFloat, device);
    TORCH_CHECK_VALUE(err->numel() >= total, "err: ", err->numel(), " elements, expected >= ", total);
    e = err->data_ptr<float>();
  }
  if (pc.n == 0) return;
  const lo::Ef mode = e == nullptr ? lo::Ef::None : (add_err ? lo::Ef::Feedback : lo::Ef::Residual);
  LO_GUARD(device);
  LO_CALL_DEV(device, onebit_seg_compress, exec_for(device), x.data_ptr<float>(), e, packed.data_ptr<uint8_t>(), pc,
              scales.data_ptr<float>(), mode);
}

// out[off + j] <- +scales[p] where bit pos + j is set, -scales[p] elsewhere.
void onebit_seg_unpack(const at::Tensor& packed, const at::Tensor& pieces, int64_t total, const at::Tensor& scales,
                       const at::Tensor& out) {
  const at::Device device = out.device();
  TORCH_CHECK_VALUE(out.is_contiguous(), "out: must be contiguous");
  lo::DType type = dtype_of(out, "out");
  lo::Pieces pc = pieces_of(pieces, total, device);
  check_pieces_fit(pieces, out, "out");
  check_flat(packed, "packed", at::kByte, device);
  TORCH_CHECK_VALUE(packed.numel() * 8 >= total, "packed: ", packed.numel(), " bytes, expected >= ", total / 8);
  check_flat(scales, "scales", at::kFloat, device);
  TORCH_CHECK_VALUE(scales.numel() == pc.n, "scales: ", scales.numel(), " values for ", pc.n, " pieces");
  if (pc.n == 0) return;
  LO_GUARD(device);
  LO_CALL_DEV(device, onebit_seg_unpack, exec_for(device), packed.data_ptr<uint8_t>(), pc, scales.data_ptr<float>(),
              type, out.data_ptr());
}

// The server's average: rows is uint8 [W, stride] (worker w's signs of this chunk at the start of row w),
// scales float32 [W, P]; err[pos + j] <- mean_w(+-scales[w, p]) + err[pos + j]; returns sum z^2 per piece.
at::Tensor onebit_server_mean(const at::Tensor& rows, const at::Tensor& scales, const at::Tensor& err,
                              const at::Tensor& pieces, int64_t total) {
  const at::Device device = err.device();
  check_flat(err, "err", at::kFloat, device);
  TORCH_CHECK_VALUE(err.numel() >= total, "err: ", err.numel(), " elements, expected >= ", total);
  lo::Pieces pc = pieces_of(pieces, total, device);
  check_flat(rows, "rows", at::kByte, device);
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(0) >= 1 && rows.size(1) * 8 >= total,
                    "rows: expected uint8 [world, >= ", total / 8, "], got ", rows.sizes());
  check_flat(scales, "scales", at::kFloat, device);
  TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == rows.size(0) && scales.size(1) == pc.n,
                    "scales: expected [", rows.size(0), ", ", pc.n, "], got ", scales.sizes());
  at::Tensor out = piece_sums_tensor(pc, device);
  if (pc.n == 0) return out;
  LO_GUARD(device);
  LO_CALL_DEV(device, onebit_server_mean, exec_for(device), rows.data_ptr<uint8_t>(), rows.size(1),
              static_cast<int>(rows.size(0)), scales.data_ptr<float>(), err.data_ptr<float>(), pc,
              out.data_ptr<double>());
  return out;
}

}  // namespace

void register_onebit(pybind11::module_& m) {
  m.def("onebit_unpack_table", &onebit_unpack_table, pybind11::arg("packed"), pybind11::arg("table"),
        pybind11::arg("out"));
  m.def("onebit_seg_sumsq", &onebit_seg_sumsq, pybind11::arg("x"), pybind11::arg("err"), pybind11::arg("pieces"),
        pybind11::arg("total"));
  m.def("onebit_momentum_sumsq", &onebit_momentum_sumsq, pybind11::arg("x"), pybind11::arg("grads"),
        pybind11::arg("err"), pybind11::arg("pieces"), pybind11::arg("total"), pybind11::arg("w1"));
  m.def("onebit_seg_compress", &onebit_seg_compress, pybind11::arg("x"), pybind11::arg("err"), pybind11::arg("packed"),
        pybind11::arg("pieces"), pybind11::arg("total"), pybind11::arg("scales"), pybind11::arg("add_err"));
  m.def("onebit_seg_unpack", &onebit_seg_unpack, pybind11::arg("packed"), pybind11::arg("pieces"),
        pybind11::arg("total"), pybind11::arg("scales"), pybind11::arg("out"));
  m.def("onebit_server_mean", &onebit_server_mean, pybind11::arg("rows"), pybind11::arg("scales"),
        pybind11::arg("err"), pybind11::arg("pieces"), pybind11::arg("total"));
}

}  // namespace lo_bind
