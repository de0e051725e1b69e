// Copies, bytes as they lie.
//
// pzlm_rows: the row gather of the embedding lookup
// (`KernelEmbeddingLookup`): copies rows ids[r] of a [V, E] table to
// out[r], so a 16-bit table is read in place (XLA:CPU converts a whole
// bfloat16 table to float32 to gather from it). Ids wrap when negative and
// clamp past the end, as numpy-style indexing does.
//
// pzlm_after: copies a (small) array once another one is ready, an order
// XLA cannot see through (`ops.after`).
//
// pzlm_split: copies the n blocks of an [n, ...] array to n results
// (`ops.split`): one call where XLA:CPU compiles a kernel per slice.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Rows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                ffi::Result<ffi::AnyBuffer> out) {
  auto td = table.dimensions();
  if (td.size() != 2 || td[0] == 0)
    return ffi::Error::InvalidArgument("rows: table [V > 0, E]");
  const int64_t V = td[0], R = ids.element_count();
  if (R == 0) return ffi::Error::Success();
  const size_t row = out->size_bytes() / R;
  if (out->element_type() != table.element_type() ||
      row * R != out->size_bytes() || row * V != table.size_bytes())
    return ffi::Error::InvalidArgument("rows: out [R, E] like the table");
  const char* src = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  for (int64_t r = 0; r < R; ++r) {
    int64_t i = id[r] < 0 ? id[r] + V : id[r];
    i = i < 0 ? 0 : (i >= V ? V - 1 : i);
    std::memcpy(dst + r * row, src + i * row, row);
  }
  return ffi::Error::Success();
}

ffi::Error After(ffi::AnyBuffer ready, ffi::AnyBuffer value,
                 ffi::Result<ffi::AnyBuffer> out) {
  (void)ready;  // Only waited for.
  if (out->element_type() != value.element_type() ||
      out->size_bytes() != value.size_bytes())
    return ffi::Error::InvalidArgument("after: out like the value");
  std::memcpy(out->untyped_data(), value.untyped_data(), value.size_bytes());
  return ffi::Error::Success();
}

ffi::Error Split(ffi::AnyBuffer x, ffi::RemainingRets outs) {
  const size_t n = outs.size();
  if (n == 0) return ffi::Error::Success();
  const size_t part = x.size_bytes() / n;
  if (part * n != x.size_bytes())
    return ffi::Error::InvalidArgument("split: [n, ...] into n results");
  const char* src = static_cast<const char*>(x.untyped_data());
  for (size_t i = 0; i < n; ++i) {
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!out.has_value()) return out.error();
    if ((*out)->element_type() != x.element_type() ||
        (*out)->size_bytes() != part)
      return ffi::Error::InvalidArgument("split: results like x's blocks");
    std::memcpy((*out)->untyped_data(), src + i * part, part);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_after, After,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_rows, Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_split, Split,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets());
