// CPU kernels of hierremat's packed-mask operator variants (hierremat/variants/packed_bits.py).
//
// A boolean mask of n elements is stored as ceil(n / 8) bytes, element i at bit (i % 8) of
// byte i / 8 (little-endian bit order, the layout numpy.packbits calls "little"). The
// schemas are defined in Python (torch.library); this file registers the CPU kernels.
// Every kernel computes bitwise what the pure-torch reference in packed_bits.py computes:
//   pack_mask(mask)                      = the packed bytes of mask (bool, any shape)
//   masked_scale(x, bits, scale)         = x.mul(unpacked mask).mul_(scale)
//   above_bits(x, threshold)             = the packed bytes of !(x <= threshold)
//   where_bits(x, bits)                  = where(unpacked mask, x, 0), in x's layout
// and their out= forms (masked_scale.out, where_bits.out), whose out may be x itself: every
// loop reads an element before it writes it, and no pointer that may alias is __restrict__.
// which for dropout is native_dropout's output (x, its mask) and native_dropout_backward
// (the output gradient, the mask). float and double run fused loops; other dtypes run the
// same ATen ops on the unpacked mask.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

namespace {

constexpr int64_t kGrain = 1 << 12;  // bytes of packed mask per parallel task: 32768 elements, ATen's grain

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

at::Tensor& masked_scale_out_cpu(const at::Tensor& x, const at::Tensor& bits, double scale, at::Tensor& out) {
  TORCH_CHECK(bits.scalar_type() == at::kByte, "masked_scale: bits must be uint8, got ", bits.scalar_type());
  TORCH_CHECK(bits.numel() == (x.numel() + 7) / 8, "masked_scale: ", bits.numel(), " bytes of mask for ", x.numel(), " elements");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "masked_scale.out: out must have x's shape and dtype");
  const auto b = bits.contiguous();
  if ((x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble) || !x.is_contiguous() || !out.is_contiguous()) {
    return at::mul_out(out, x, unpack_mask(b, x.sizes())).mul_(scale);
  }
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "masked_scale_cpu", [&] {
    // a Scalar multiplying a float tensor is applied in the tensor's dtype
    masked_scale_loop<scalar_t>(x.const_data_ptr<scalar_t>(), b.data_ptr<uint8_t>(), out.data_ptr<scalar_t>(), x.numel(),
                                static_cast<scalar_t>(scale));
  });
  return out;
}

at::Tensor masked_scale_cpu(const at::Tensor& x, const at::Tensor& bits, double scale) {
  const auto xc = x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble ? x.contiguous() : x;
  auto out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  return masked_scale_out_cpu(xc, bits, scale, out);
}

template <typename scalar_t>
void above_bits_loop(const scalar_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t n, scalar_t t) {
  const int64_t full = n / 8;
  at::parallel_for(0, full, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const scalar_t* x = src + b * 8;
      uint8_t above[8];
      for (int j = 0; j < 8; ++j) above[j] = !(x[j] <= t);
      uint8_t byte = 0;
      for (int j = 0; j < 8; ++j) byte |= above[j] << j;
      dst[b] = byte;
    }
  });
  if (full * 8 < n) {
    uint8_t byte = 0;
    for (int64_t i = full * 8; i < n; ++i) byte |= static_cast<uint8_t>(!(src[i] <= t)) << (i - full * 8);
    dst[full] = byte;
  }
}

at::Tensor above_bits_cpu(const at::Tensor& x, double threshold) {
  const auto xc = x.contiguous();
  const int64_t n = xc.numel();
  auto bits = at::empty({(n + 7) / 8}, xc.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "above_bits_cpu", [&] {
    // threshold_backward compares in the tensor's dtype: the threshold is cast to it first
    above_bits_loop<scalar_t>(xc.data_ptr<scalar_t>(), bits.data_ptr<uint8_t>(), n, static_cast<scalar_t>(threshold));
  });
  return bits;
}

// where(mask, x, +0) on the bit patterns: x's bits, or all-zero bits (+0), so NaN payloads and
// signed zeros pass through exactly as threshold_backward passes them.
template <typename word_t>
struct ByteLanes {
  // lanes[m][j]: all ones where bit j of mask byte m is set, else 0 (a table, so the loop
  // below is a plain vectorizable AND)
  word_t lanes[256][8];
  ByteLanes() {
    for (int m = 0; m < 256; ++m)
      for (int j = 0; j < 8; ++j) lanes[m][j] = ((m >> j) & 1) ? static_cast<word_t>(~word_t(0)) : word_t(0);
  }
};

template <typename word_t>
void where_bits_loop(const word_t* src, const uint8_t* __restrict__ mask, word_t* dst, int64_t n) {
  static const ByteLanes<word_t> table;
  const int64_t full = n / 8;
  at::parallel_for(0, full, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const word_t* __restrict__ lane = table.lanes[mask[b]];
      const word_t* x = src + b * 8;
      word_t* out = dst + b * 8;
      for (int j = 0; j < 8; ++j) out[j] = x[j] & lane[j];
    }
  });
  for (int64_t i = full * 8; i < n; ++i) dst[i] = src[i] & table.lanes[mask[full]][i - full * 8];
}

at::Tensor& where_bits_out_cpu(const at::Tensor& x, const at::Tensor& bits, at::Tensor& out) {
  TORCH_CHECK(bits.scalar_type() == at::kByte, "where_bits: bits must be uint8, got ", bits.scalar_type());
  TORCH_CHECK(bits.numel() == (x.numel() + 7) / 8, "where_bits: ", bits.numel(), " bytes of mask for ", x.numel(), " elements");
  TORCH_CHECK(x.is_floating_point(), "where_bits: x must be floating point, got ", x.scalar_type());
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "where_bits.out: out must have x's shape and dtype");
  const auto b = bits.contiguous();
  if (!out.is_contiguous()) {  // the mask is in logical order: let ATen place it
    return at::where_out(out, unpack_mask(b, x.sizes()), x, at::zeros({}, x.options()));
  }
  // x in logical order: x itself, or (a slice of a larger gradient, say) copied into out, then masked in place there
  const void* src = x.is_contiguous() ? x.const_data_ptr() : out.copy_(x).const_data_ptr();
  const int64_t n = x.numel();
  const uint8_t* mask = b.data_ptr<uint8_t>();
  switch (x.element_size()) {
    case 8:
      where_bits_loop<uint64_t>(static_cast<const uint64_t*>(src), mask, static_cast<uint64_t*>(out.data_ptr()), n);
      break;
    case 4:
      where_bits_loop<uint32_t>(static_cast<const uint32_t*>(src), mask, static_cast<uint32_t*>(out.data_ptr()), n);
      break;
    case 2:
      where_bits_loop<uint16_t>(static_cast<const uint16_t*>(src), mask, static_cast<uint16_t*>(out.data_ptr()), n);
      break;
    default:
      TORCH_CHECK(false, "where_bits: unsupported element size ", x.element_size());
  }
  return out;
}

at::Tensor where_bits_cpu(const at::Tensor& x, const at::Tensor& bits) {
  auto out = x.is_contiguous() ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::empty_like(x);
  return where_bits_out_cpu(x, bits, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(hierremat, CPU, m) {
  m.impl("pack_mask", &pack_mask_cpu);
  m.impl("masked_scale", &masked_scale_cpu);
  m.impl("above_bits", &above_bits_cpu);
  m.impl("where_bits", &where_bits_cpu);
  m.impl("masked_scale.out", &masked_scale_out_cpu);
  m.impl("where_bits.out", &where_bits_out_cpu);
}
