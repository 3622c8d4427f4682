// llgraph's ONNX Runtime CPU kernels: custom ops of domain "llgraph", loaded with
// SessionOptions.register_custom_ops_library. plugins/cpu/__init__.py builds this file once per machine, with -O3: the
// tiles' accumulator arrays must be unrolled into registers, which -O2 leaves on the stack (half the speed).
//
// QLinear: y = x @ w^T + bias, w[o, b*B + j] = scales[o, b] * (q[o, b, j] - zero_point) + mins[o, b], the codes
// as llgraph stores them (llgraph/ops.py, llgraph/quant.py: [out, in/B, B*bits/8], 4-bit two per byte, low nibble
// first). Exact mode: fp32 activations, fp32 accumulation, computed as
//     y[m, o] = sum_b scales[o, b] * (q[o, b, :] . x[m, b, :]) + sum_b (mins[o, b] - scales[o, b] * zp) * xsum[m, b]
// (xsum: the block sums of x), so the mins cost one multiply-add per block and the weights are read once, as
// stored. For 4-bit codes each block of x is first split into its even and odd elements, so a byte's low and high
// nibbles meet their x values without any shuffle.
//
// Accuracy level 4 (the node's accuracy_level attribute, as MatMulNBits'): int8 activations and integer dots
// (qlinear_int8.inc), AVX-512 VNNI where the CPU has it, AVX2 for 4-bit codes, else the same arithmetic portably.
//
// Layouts: the blocks as stored, or interleaved 16 rows at a time (interleave=16, what the ort export writes:
// qlinear_groups.inc exact, qlinear_int8.inc level 4), whose scales and mins may be half floats; on it,
// activation=swiglu computes silu(gate) * up of a packed [gate; up] projection, and QEmbedding gathers a (tied)
// table's rows from the same bytes (qembedding.inc). GroupedAttention (attention.inc, attention_simd.inc,
// kv_rows.inc): the layer's attention, rotary inside, over a float32, float16 or int8 cache. Exact kernels on
// blocks: qlinear_blocks.inc; GGUF's K-quant super-blocks: superblocks.inc. MoE (moe.inc): routed experts in
// super-blocks, each token through its k, on QLinear's kernels.
//
// Instruction sets: AVX-512 VNNI (level 4), AVX-512F, AVX2+FMA and a portable scalar loop, each compiled inside its
// own target region (no build flag tied to the building CPU) and chosen when the library loads from the CPU's
// features (isa.inc), job by job through one table (dispatch.inc); the environment variable
// LLGRAPH_CPU_ISA=avx512vnni|avx512|avx2|scalar caps the choice (tests run every path). Output rows are split over
// ONNX Runtime's own intra-op thread pool (KernelContext::ParallelFor), so session threads are obeyed.

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

#include "isa.inc"

// at most about this many work items a node (a large node's row groups taken several at a time): each item is a
// claim on ONNX Runtime's shared counter, and the lm head's 3,072 one-group items cost more in claims than the
// imbalance of 256 items does
constexpr int64_t kItems = 256;

struct Problem {
  const float* x;         // [M, K]: for 4-bit codes, each block reordered as (even elements, odd elements)
  const float* xsum;      // [M, nb]: the block sums of x
  const uint8_t* codes;   // [N, nb, B*bits/8]
  const float* scales;    // [N, nb]
  const float* mins;      // [N, nb] or null
  const uint16_t* hscales;  // the interleaved layout's scales as half floats (GGUF's own, widened losslessly), else
  const uint16_t* hmins;    // null; its mins the same
  const float* bias;      // [N] or null
  float* y;               // [M, N]
  int64_t M, K, N, nb, B, bits, zero_point, chunk;
  Isa isa;
  const struct Int8X* int8;  // level 4: x quantized (qlinear_int8.inc); null: exact
  const struct Int8Blocks* int8b;  // level 4 on the interleaved layout: x quantized per block; chunks are groups
  int64_t centre;  // the code the dots are centred on, 2^(code_bits - 1) (level 4, and exact on the interleaved
                   // layout)
  bool groups;     // exact on the interleaved layout (qlinear_groups.inc): x as given, chunks are groups of 16 rows
  float* glu;      // activation=swiglu: the output [M, glu_rows], silu(gate) * up of y's row pairs (y: scratch whose
  int64_t glu_rows;  // groups alternate 16 gate rows, 16 up rows); null: y is the output
  int sb = 0;      // GGUF super-blocks (superblocks.inc: kQ4K .. kQ2K) on the interleaved layout; 0: blocks
  const struct Int8K* int8k = nullptr;  // level 4 on super-blocks: x quantized per 32; null: exact (x, xsum)
  const float* xsum16 = nullptr;        // exact on Q2_K: the sums of x per 16
};

// IEEE half -> float, exactly (normals, subnormals, infinities)
float HalfToFloat(uint16_t h) {
  const int exponent = (h >> 10) & 31, mantissa = h & 1023;
  float v = exponent == 0    ? std::ldexp(static_cast<float>(mantissa), -24)
            : exponent == 31 ? (mantissa ? NAN : INFINITY)
                             : std::ldexp(static_cast<float>(mantissa | 1024), exponent - 25);
  return (h & 0x8000) ? -v : v;
}

#include "qlinear_blocks.inc"


namespace {

#include "qlinear_int8.inc"
#include "superblocks.inc"

}  // namespace

#include "attention_simd.inc"
#include "kv_rows.inc"

namespace {

#include "dispatch.inc"

// the blocked format's attributes (llgraph/ops.py QUANT_ATTRS), which QLinear and QEmbedding share
struct BlockFormat {
  explicit BlockFormat(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo k(info);
    bits_ = k.GetAttribute<int64_t>("bits");
    block_ = k.GetAttribute<int64_t>("block_size");
    zero_point_ = k.GetAttribute<int64_t>("zero_point");
    size_t length = 0;  // "format": blocks (absent in exports before 0.6), or a GGUF super-block format
    if (OrtStatus* absent = Ort::GetApi().KernelInfoGetAttribute_string(info, "format", nullptr, &length)) {
      Ort::GetApi().ReleaseStatus(absent);
    } else {
      const std::string format = k.GetAttribute<std::string>("format");
      sb_ = SuperKind(format);
      if (sb_ == 0 && format != "blocks")
        ORT_CXX_API_THROW("llgraph: format must be blocks, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL or MXFP4",
                          ORT_INVALID_ARGUMENT);
      if (sb_ != 0 && block_ != kLayouts[sb_].per)
        ORT_CXX_API_THROW("llgraph: a super-block format's block_size is its weights a block (256; IQ4_NL, MXFP4 32)",
                          ORT_INVALID_ARGUMENT);
    }
  }
  // the bytes of one block of 16 interleaved rows (a super-block's, or block * bits / 8 of each row)
  int64_t GroupBytes() const { return sb_ ? kLayouts[sb_].bytes : 16 * block_ * bits_ / 8; }

  // An optional input, when present, holds exactly `want` values of float (or, with `half_ok`, float16): a graph
  // that disagrees with the node's shapes fails the node with a message, never reads past a buffer.
  static void Expect(Ort::KernelContext& ctx, size_t index, int64_t want, const char* op, const char* name,
                     bool half_ok) {
    if (index >= ctx.GetInputCount()) return;
    const Ort::ConstValue v = ctx.GetInput(index);
    if (static_cast<const OrtValue*>(v) == nullptr) return;
    const Ort::TensorTypeAndShapeInfo info = v.GetTensorTypeAndShapeInfo();
    const ONNXTensorElementDataType type = info.GetElementType();
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && !(half_ok && type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16))
      ORT_CXX_API_THROW(std::string("llgraph ") + op + ": " + name + " must be float" + (half_ok ? " or float16" : ""),
                        ORT_INVALID_ARGUMENT);
    const int64_t have = static_cast<int64_t>(info.GetElementCount());
    if (have != want)
      ORT_CXX_API_THROW(std::string("llgraph ") + op + ": " + name + " holds " + std::to_string(have) +
                            " values where the node's shapes need " + std::to_string(want),
                        ORT_INVALID_ARGUMENT);
  }
  int64_t bits_, block_, zero_point_;
  int sb_ = 0;
};

// A QLinear's working buffers (x normed, reordered or quantized, its block sums, the gate and up rows of a swiglu),
// one set per calling thread, which every node reuses: a node runs whole before the next on that thread, so the
// process holds the largest node's buffers once, not every node's own (at a 2,048-token prefill of an 8B, 13 GB)
struct Scratch {
  std::vector<float> reordered, sums, sums16, glu, normed, scaled;
  Int8X int8x;
  Int8Blocks int8b;
  Int8K int8k;
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

struct QLinearKernel : BlockFormat {
  QLinearKernel(const OrtApi&, const OrtKernelInfo* info) : BlockFormat(info) {
    Ort::ConstKernelInfo k(info);
    const int64_t level = OptionalAttribute(info, "accuracy_level", 0);  // as MatMulNBits': 4 is int8 activations
    interleave_ = OptionalAttribute(info, "interleave", 0);
    if (interleave_ != 0 && interleave_ != 16)
      ORT_CXX_API_THROW("llgraph QLinear: interleave must be 0 or 16", ORT_INVALID_ARGUMENT);
    if (sb_ == 0 && ((bits_ != 4 && bits_ != 5 && bits_ != 8) || block_ < 16 || (block_ & (block_ - 1)) != 0))
      ORT_CXX_API_THROW("llgraph QLinear: bits must be 4, 5 or 8 and block_size a power of 2 >= 16",
                        ORT_INVALID_ARGUMENT);
    if (sb_ == 0 && bits_ == 5 && (block_ != 32 || interleave_ != 16))  // GGUF's Q5_0/Q5_1 as stored
      ORT_CXX_API_THROW("llgraph QLinear: 5-bit codes are read in blocks of 32, interleaved (interleave=16)",
                        ORT_INVALID_ARGUMENT);
    rows_ = interleave_ ? k.GetAttribute<int64_t>("rows") : 0;
    glu_ = OptionalAttribute(info, "activation", 0);  // 1: swiglu over the interleaved gate/up row groups
    float eps = 0.f;  // with a norm weight input: x's RMSNorm first, with this epsilon
    if (OrtStatus* absent = Ort::GetApi().KernelInfoGetAttribute_float(info, "epsilon", &eps))
      Ort::GetApi().ReleaseStatus(absent);
    eps_ = eps;
    if (glu_ != 0 && (glu_ != 1 || !interleave_))
      ORT_CXX_API_THROW("llgraph QLinear: activation must be 0, or 1 (swiglu) on the interleaved layout",
                        ORT_INVALID_ARGUMENT);
    const int64_t code_bits = OptionalAttribute(info, "code_bits", bits_);  // Q5_K's and Q6_K's 5 and 6 in 8
    centre_ = int64_t{1} << (std::min(std::max<int64_t>(code_bits, 1), bits_) - 1);
    if (sb_ != 0 && interleave_ != 16)
      ORT_CXX_API_THROW("llgraph QLinear: super-blocks are read interleaved (interleave=16)", ORT_INVALID_ARGUMENT);
    int8_ = level == 4 && (interleave_ != 0 || Int8Fits(bits_, block_));
    times_ = PowerOfTwo(info, "exponent");
  }

  // 2^e for the node's integer attribute `name` (0 when absent; -8..8): the weights are 2^e times what the
  // super-blocks say (ops.py's `exponent`: IQ3_XXS carried as Q6_K with its own d), which the kernels apply to x
  // before the product: exact (a power of two scales x, its int8 scales and its block sums alike), and before
  // any bias, residual or activation the node fuses
  static float PowerOfTwo(const OrtKernelInfo* info, const char* name) {
    const int64_t e = OptionalAttribute(info, name, 0);
    if (e < -8 || e > 8) ORT_CXX_API_THROW("llgraph: exponent must be within -8..8", ORT_INVALID_ARGUMENT);
    return std::ldexp(1.f, static_cast<int>(e));
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Scratch& s = ThreadScratch();
    const Ort::ConstValue x = ctx.GetInput(0), codes = ctx.GetInput(1);
    const Ort::ConstValue scales = ctx.GetInputCount() > 2 ? ctx.GetInput(2) : Ort::ConstValue{nullptr};
    if ((sb_ == 0) != (static_cast<const OrtValue*>(scales) != nullptr))
      ORT_CXX_API_THROW("llgraph QLinear: the blocked format takes scales, super-blocks none", ORT_INVALID_ARGUMENT);
    const std::vector<int64_t> xs = x.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> cs = codes.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t groups = glu_ ? cs[0] / 2 : cs[0];  // swiglu: gate and up groups
    if (xs.empty() || cs.size() != 3 || cs[1] * block_ != xs.back() ||
        cs[2] != (interleave_ ? GroupBytes() : block_ * bits_ / 8) ||
        (interleave_ && (rows_ > groups * 16 || rows_ <= (groups - 1) * 16 || (glu_ && cs[0] % 2))))
      ORT_CXX_API_THROW("llgraph QLinear: codes must be [out, in/block, block*bits/8] (interleaved: [ceil(rows/16), "
                        "in/block, 16*block*bits/8], swiglu twice the groups) matching x's last dim",
                        ORT_INVALID_ARGUMENT);
    if (glu_ && ctx.GetInputCount() > 4 && static_cast<const OrtValue*>(ctx.GetInput(4)) != nullptr)
      ORT_CXX_API_THROW("llgraph QLinear: activation=swiglu takes no bias", ORT_INVALID_ARGUMENT);
    const int64_t K = xs.back(), N = glu_ ? cs[0] * 16 : interleave_ ? rows_ : cs[0], nb = cs[1];
    int64_t M = 1;
    for (size_t i = 0; i + 1 < xs.size(); ++i) M *= xs[i];
    const int64_t per_block = cs[0] * nb * (interleave_ ? 16 : 1);  // a scale (and min) per row and block
    Expect(ctx, 2, per_block, "QLinear", "scales", interleave_ != 0);
    Expect(ctx, 3, per_block, "QLinear", "mins", interleave_ != 0);
    Expect(ctx, 4, N, "QLinear", "bias", false);
    Expect(ctx, 5, M * (glu_ ? rows_ : N), "QLinear", "residual", false);
    Expect(ctx, 6, K, "QLinear", "norm weight", false);
    std::vector<int64_t> ys(xs);
    ys.back() = glu_ ? rows_ : N;
    float* out = ctx.GetOutput(0, ys).GetTensorMutableData<float>();
    float* glu = nullptr;
    if (glu_) {  // the gate and up rows land in scratch; the output is their silu(gate) * up
      glu = out;
      s.glu.resize(static_cast<size_t>(M * N));
      out = s.glu.data();
    }

    const float* in = x.GetTensorData<float>();
    if (const float* norm = Optional(ctx, 6)) {  // RMSNorm(x) * weight, in float32, as the graph's would
      s.normed.resize(static_cast<size_t>(M * K));
      for (int64_t m = 0; m < M; ++m) {
        const float* row = in + m * K;
        float part[16] = {};  // 16 running sums, which the compiler keeps in vector registers
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
          for (int l = 0; l < 16; ++l) part[l] += row[k + l] * row[k + l];
        float ss = 0.f;
        for (; k < K; ++k) ss += row[k] * row[k];
        for (int l = 0; l < 16; ++l) ss += part[l];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + eps_);
        for (int64_t k = 0; k < K; ++k) s.normed[m * K + k] = in[m * K + k] * inv * norm[k];
      }
      in = s.normed.data();
    }
    if (times_ != 1.f) {  // the exponent, on x (PowerOfTwo)
      s.scaled.resize(static_cast<size_t>(M * K));
      for (int64_t i = 0; i < M * K; ++i) s.scaled[i] = in[i] * times_;
      in = s.scaled.data();
    }
    const bool half = Half(scales);
    const Ort::ConstValue mins = ctx.GetInputCount() > 3 ? ctx.GetInput(3) : Ort::ConstValue{nullptr};
    if ((half || Half(mins)) && !interleave_)
      ORT_CXX_API_THROW("llgraph QLinear: half-float scales and mins are for the interleaved layout only",
                        ORT_INVALID_ARGUMENT);
    Problem p{nullptr, nullptr, codes.GetTensorData<uint8_t>(), half || sb_ ? nullptr : scales.GetTensorData<float>(),
              Half(mins) ? nullptr : Optional(ctx, 3), half ? scales.GetTensorData<uint16_t>() : nullptr,
              Half(mins) ? mins.GetTensorData<uint16_t>() : nullptr, Optional(ctx, 4), out, M, K, N, nb, block_,
              bits_, zero_point_, 16, g_isa, nullptr, nullptr, centre_, interleave_ != 0 && !int8_, glu, rows_};
    p.sb = sb_;
    if (sb_ != 0 && int8_) {
      QuantizeK(in, M, K, Pick(&Kernels::quantize, g_isa, int64_t{32}), s.int8k, sb_ == kQ2K);
      p.int8k = &s.int8k;
    } else if (sb_ != 0) {  // exact: x as given, its sums per 32 (Q2_K: and per 16)
      Sums(in, M * K / 32, 32, s);
      p.x = in;
      p.xsum = s.sums.data();
      if (sb_ == kQ2K) {
        Sums16(in, M * K / 16, s.sums16);
        p.xsum16 = s.sums16.data();
      }
    } else if (p.groups) {
      Sums(in, M * nb, block_, s);
      p.x = in;
      p.xsum = s.sums.data();
    } else if (interleave_) {
      QuantizeBlocks(in, M, K, block_, bits_, centre_, Pick(&Kernels::quantize, g_isa, block_), s.int8b);
      p.int8b = &s.int8b;
    } else if (int8_) {
      QuantizeX(in, M, K, block_, bits_, centre_, s.int8x);
      p.int8 = &s.int8x;
    } else {
      Reorder(in, M * nb, s);
      p.x = s.reordered.data();
      p.xsum = s.sums.data();
    }
    // a chunk of at least two groups where super-blocks meet many rows: the Panel path takes them in pairs
    if (interleave_ && !glu_) p.chunk = 16 * std::max<int64_t>(p.sb != 0 && M >= 8 ? 2 : 1, (N + 15) / 16 / kItems);
    const size_t chunks = static_cast<size_t>(glu_ ? N / 32 : (N + p.chunk - 1) / p.chunk);
    ctx.ParallelFor(Chunk, chunks, 0, &p);
    if (const float* residual = Optional(ctx, 5)) {  // y + residual: the residual stream's Add
      const int64_t count = M * (glu_ ? rows_ : N);
      float* y = glu_ ? glu : out;
      for (int64_t i = 0; i < count; ++i) y[i] += residual[i];
    }
  }

  // the block sums of x (the interleaved exact kernels read x itself)
  void Sums(const float* in, int64_t blocks, int64_t width, Scratch& s) {
    s.sums.resize(static_cast<size_t>(blocks));
    for (int64_t r = 0; r < blocks; ++r) {
      float sum = 0.f;
      for (int64_t j = 0; j < width; ++j) sum += in[r * width + j];
      s.sums[r] = sum;
    }
  }

  // x as the exact kernels read it (4-bit: each block's even elements, then its odd ones) and its block sums
  void Reorder(const float* in, int64_t blocks, Scratch& s) {
    s.reordered.resize(static_cast<size_t>(blocks * block_));
    s.sums.resize(static_cast<size_t>(blocks));
    const int64_t half = block_ / 2;
    for (int64_t r = 0; r < blocks; ++r) {
      const float* src = in + r * block_;
      float* dst = s.reordered.data() + r * block_;
      float sum = 0.f;
      for (int64_t j = 0; j < block_; ++j) sum += src[j];
      s.sums[r] = sum;
      if (bits_ == 4) {
        for (int64_t k = 0; k < half; ++k) {
          dst[k] = src[2 * k];
          dst[half + k] = src[2 * k + 1];
        }
      } else {
        std::memcpy(dst, src, sizeof(float) * block_);
      }
    }
  }

  // an integer attribute the node may leave out
  static int64_t OptionalAttribute(const OrtKernelInfo* info, const char* name, int64_t otherwise) {
    int64_t value = otherwise;
    if (OrtStatus* absent = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &value)) {
      Ort::GetApi().ReleaseStatus(absent);
      return otherwise;
    }
    return value;
  }

  // whether an input (present) holds half floats
  static bool Half(const Ort::ConstValue& v) {
    return static_cast<const OrtValue*>(v) != nullptr &&
           v.GetTensorTypeAndShapeInfo().GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  }

  // an optional input's data, or null when the node leaves it out (named "" or past its last input)
  static const float* Optional(Ort::KernelContext& ctx, size_t index) {
    if (index >= ctx.GetInputCount()) return nullptr;
    const Ort::ConstValue v = ctx.GetInput(index);
    return static_cast<const OrtValue*>(v) != nullptr ? v.GetTensorData<float>() : nullptr;
  }

  int64_t interleave_, rows_, centre_, glu_;
  float eps_, times_;
  bool int8_;
};

struct QLinearOp : Ort::CustomOpBase<QLinearOp, QLinearKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new QLinearKernel(api, info); }
  const char* GetName() const { return "QLinear"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 7; }  // x, codes, scales?, mins?, bias?, residual?, norm weight?
  ONNXTensorElementDataType GetInputType(size_t i) const {  // scales and mins: float, or half (interleaved)
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
                  : i == 2 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;  // super-blocks: no scales
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

#include "qembedding.inc"
#include "moe.inc"

}  // namespace

#include "attention.inc"

// The C API version asked of the runtime: the headers' own (a test builds one newer than any runtime)
#ifndef LLGRAPH_ORT_API
#define LLGRAPH_ORT_API ORT_API_VERSION
#endif

extern "C" {

// The instruction set the kernels run with here (after LLGRAPH_CPU_ISA): "avx512vnni", "avx512", "avx2" or
// "scalar".
__attribute__((visibility("default"))) const char* llgraph_cpu_isa() { return kIsaNames[g_isa]; }

// The ONNX Runtime API version this library was built against: it runs on that runtime or a newer one.
__attribute__((visibility("default"))) int llgraph_ort_api_version() { return LLGRAPH_ORT_API; }

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                     const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(LLGRAPH_ORT_API);
  if (api == nullptr) {  // a runtime older than these headers: say so, through the oldest API every runtime has
    const std::string why = "llgraph's CPU kernels were built for ONNX Runtime's C API " +
                            std::to_string(LLGRAPH_ORT_API) + " (ONNX Runtime 1." + std::to_string(LLGRAPH_ORT_API) +
                            "), newer than this onnxruntime (" + api_base->GetVersionString() +
                            "); upgrade onnxruntime, or re-export with --kernels standard";
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, why.c_str());
  }
  Ort::InitApi(api);
  static QLinearOp qlinear;
  static QEmbeddingOp qembedding;
  static GroupedAttentionOp attention;
  static MoeOp moe;
  static Ort::CustomOpDomain domain{"llgraph"};
  static bool added = false;
  if (!added) {
    domain.Add(&qlinear);
    domain.Add(&qembedding);
    domain.Add(&attention);
    domain.Add(&moe);
    added = true;
  }
  try {
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}

}  // extern "C"
