// CPU kernels of hierremat's packed-mask operator variants (hierremat/variants/packed_bits.py).
//
// A boolean mask of n elements is stored as ceil(n / 8) bytes, element i at bit (i % 8) of
// byte i / 8 (little-endian bit order, the layout numpy.packbits calls "little"). The
// schemas are defined in Python (torch.library); this file registers the CPU kernels.
// Every kernel computes bitwise what the pure-torch reference in packed_bits.py computes:
//   pack_mask(mask)                      = the packed bytes of mask (bool, any shape)
//   masked_scale(x, bits, scale)         = x.mul(unpacked mask).mul_(scale)
// which for dropout is native_dropout's output (x, its mask) and native_dropout_backward
// (the output gradient, the mask). float and double run fused loops; other dtypes run the
// same ATen ops on the unpacked mask.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

namespace {

constexpr int64_t kGrain = 1 << 14;  // bytes of packed mask per parallel task

at::Tensor pack_mask_cpu(const at::Tensor& mask) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, "pack_mask: mask must be bool, got ", mask.scalar_type());
  const auto m = mask.contiguous();
  const int64_t n = m.numel();
  const int64_t nbytes = (n + 7) / 8;
  auto bits = at::empty({nbytes}, m.options().dtype(at::kByte));
  const bool* src = m.data_ptr<bool>();
  uint8_t* dst = bits.data_ptr<uint8_t>();
  at::parallel_for(0, nbytes, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * 8;
      const int64_t count = std::min<int64_t>(8, n - first);
      uint8_t byte = 0;
      for (int64_t j = 0; j < count; ++j) {
        byte |= static_cast<uint8_t>(src[first + j]) << j;
      }
      dst[b] = byte;
    }
  });
  return bits;
}

at::Tensor unpack_mask(const at::Tensor& bits, at::IntArrayRef shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  auto mask = at::empty({n}, bits.options().dtype(at::kBool));
  const uint8_t* src = bits.data_ptr<uint8_t>();
  bool* dst = mask.data_ptr<bool>();
  at::parallel_for(0, n, kGrain * 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = (src[i >> 3] >> (i & 7)) & 1;
  });
  return mask.view(shape);
}

template <typename scalar_t>
void masked_scale_loop(const scalar_t* x, const uint8_t* bits, scalar_t* out, int64_t n, scalar_t scale) {
  at::parallel_for(0, (n + 7) / 8, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t byte = bits[b];
      const int64_t first = b * 8;
      const int64_t count = std::min<int64_t>(8, n - first);
      for (int64_t j = 0; j < count; ++j) {
        // the order of x.mul(mask).mul_(scale): (x * m) * scale, m in {0, 1}
        const scalar_t m = static_cast<scalar_t>((byte >> j) & 1);
        out[first + j] = (x[first + j] * m) * scale;
      }
    }
  });
}

at::Tensor masked_scale_cpu(const at::Tensor& x, const at::Tensor& bits, double scale) {
  TORCH_CHECK(bits.scalar_type() == at::kByte, "masked_scale: bits must be uint8, got ", bits.scalar_type());
  TORCH_CHECK(bits.numel() == (x.numel() + 7) / 8, "masked_scale: ", bits.numel(), " bytes of mask for ", x.numel(), " elements");
  const auto b = bits.contiguous();
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble) {
    return x.mul(unpack_mask(b, x.sizes())).mul_(scale);
  }
  const auto xc = x.contiguous();
  auto out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES(xc.scalar_type(), "masked_scale_cpu", [&] {
    // a Scalar multiplying a float tensor is applied in the tensor's dtype
    masked_scale_loop<scalar_t>(xc.data_ptr<scalar_t>(), b.data_ptr<uint8_t>(), out.data_ptr<scalar_t>(), xc.numel(),
                                static_cast<scalar_t>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hierremat, CPU, m) {
  m.impl("pack_mask", &pack_mask_cpu);
  m.impl("masked_scale", &masked_scale_cpu);
}
