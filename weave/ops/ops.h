#pragma once
// Every tensor op. Ops broadcast like NumPy, promote dtypes like PyTorch, record autograd
// when an input requires grad (and grad mode is on), and raise weave::Error starting with
// "[op]" on bad input. Dims may be negative (counted from the end).
#include <optional>
#include <string>
#include <vector>

#include "weave/tensor/random.h"
#include "weave/tensor/tensor.h"

namespace weave {

// ---- creation ---------------------------------------------------------------------------

Tensor zeros(const Shape& shape, TensorOptions options = {});
Tensor ones(const Shape& shape, TensorOptions options = {});
Tensor full(const Shape& shape, double value, TensorOptions options = {});
/// Same shape, dtype and device as t.
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
/// A 0-d tensor holding value.
Tensor scalar_tensor(double value, TensorOptions options = {});
/// start, start+step, ... below end (1-D).
Tensor arange(double start, double end, double step = 1.0, TensorOptions options = {});
Tensor arange(double end, TensorOptions options = {});
/// n x m identity (m defaults to n).
Tensor eye(int64_t n, int64_t m = -1, TensorOptions options = {});
/// Uniform in [0, 1); seeded by `generator` (the default generator when null).
Tensor rand(const Shape& shape, TensorOptions options = {}, Generator* generator = nullptr);
/// Standard normal.
Tensor randn(const Shape& shape, TensorOptions options = {}, Generator* generator = nullptr);
/// Uniform integers in [low, high); dtype defaults to int64.
Tensor randint(int64_t low, int64_t high, const Shape& shape,
               TensorOptions options = {.dtype = kInt64}, Generator* generator = nullptr);
/// Copies values (row-major) into a new tensor of the given shape (1-D when shape is empty;
/// use scalar_tensor for a 0-d tensor).
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape = {}, Device device = kCPU);
/// Wraps host or device memory without copying; deleter (may be empty) runs when the
/// tensor's storage dies.
Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device = kCPU,
                 std::function<void(void*)> deleter = {});

// ---- elementwise ------------------------------------------------------------------------

Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
/// 1 / sqrt(x).
Tensor rsqrt(const Tensor& x);
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
/// Exact GELU: x * Phi(x) with the normal CDF Phi.
Tensor gelu(const Tensor& x);
/// GELU's tanh approximation, x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (PyTorch's
/// approximate="tanh", GPT-2's).
Tensor gelu_tanh(const Tensor& x);
/// x * sigmoid(x).
Tensor silu(const Tensor& x);
/// -1, 0 or 1 by the sign of x (NaN stays NaN); its gradient is zero.
Tensor sign(const Tensor& x);
/// x * x, in one pass (its gradient 2x).
Tensor square(const Tensor& x);
/// x limited to [min, max] (either bound may be left out); NaN stays NaN. The gradient passes
/// where min <= x <= max, as in PyTorch. A NaN bound, or min > max, raises.
Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max = std::nullopt);

/// Elementwise tests (bool tensors, not differentiable); integer tensors are always finite.
Tensor isnan(const Tensor& x);
Tensor isinf(const Tensor& x);
Tensor isfinite(const Tensor& x);
/// True when no element of x is NaN or infinite (one pass, no bool tensor kept).
bool all_finite(const Tensor& x);
/// The same for every defined tensor of the list, with one host read for all of them when they
/// are finite (each tensor's sum added up in float64), not one per tensor.
bool all_finite(const std::vector<Tensor>& tensors);

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
/// True division: integer inputs give a floating result.
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& base, const Tensor& exponent);
Tensor pow(const Tensor& base, double exponent);
/// Elementwise max / min; at ties the gradient is split equally.
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);

/// Comparisons return bool tensors and are not differentiable.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
/// cond ? a : b, broadcasting all three; cond must be bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

// Scalars act like 0-d tensors that do not widen the tensor's dtype (int tensor * 0.5 is
// float32; float16 tensor + 1.0 stays float16).
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& x);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);
/// A 0-d tensor for `value` in the dtype a scalar operand of `like` takes.
Tensor wrap_scalar(double value, const Tensor& like);

// ---- reductions (dims empty = all dims) -------------------------------------------------

/// Integer and bool inputs sum to int64.
Tensor sum(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
/// Maximum over dims; at ties the gradient is split equally.
Tensor max(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
Tensor min(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
/// Index (int64) of the first maximum along dim, or in the flattened tensor.
Tensor argmax(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
Tensor argmin(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
/// Variance with Bessel's correction by default (divides by N - correction).
Tensor var(const Tensor& x, const Dims& dims = {}, int64_t correction = 1, bool keepdim = false);
/// Sums a broadcast gradient back down to `shape` (the adjoint of expand).
Tensor sum_to(const Tensor& x, const Shape& shape);

// ---- linear algebra ---------------------------------------------------------------------

/// Matrix product with NumPy semantics: 1-D operands are promoted and squeezed, batch
/// dimensions broadcast.
Tensor matmul(const Tensor& a, const Tensor& b);
/// x @ weight^T + bias, weight [out, in], bias [out] (may be undefined).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});
/// linear over rows in groups (a mixture of experts' projection over its tokens sorted by
/// expert): the first counts[0] rows of x [R, in] times weights[0]^T (+ biases[0]), the next
/// counts[1] times weights[1]^T, and so on, into one [R, out]. Each weight is [out..., in]
/// (viewed as [out, in]: a gated MLP's [2, hidden, in] gate_up), every one the same shape;
/// biases are empty or one per weight ([out...]). One GEMM per group and one autograd node for
/// them all; a group of no rows gets a zero gradient.
Tensor grouped_linear(const Tensor& x, const std::vector<Tensor>& weights,
                      const std::vector<int64_t>& counts, const std::vector<Tensor>& biases = {});
/// out[t] = sum_j weight[t, j] * rows[index[t, j]] for rows [R, H], int64 index [T, K] (a
/// negative entry adds nothing) and weight [T, K]: a mixture of experts' combine (each token's
/// experts' outputs weighted by its gates) in one pass, without the [T, K, H] gather.
/// Differentiable in rows and weight; [T, H] in rows' dtype.
Tensor gather_weighted_sum(const Tensor& rows, const Tensor& index, const Tensor& weight);

// ---- shape ------------------------------------------------------------------------------

/// One dimension may be -1 (inferred). Returns a view when the strides allow, else a copy.
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor view(const Tensor& x, const Shape& shape);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor permute(const Tensor& x, const Dims& order);
Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
/// Removes dim by indexing it.
Tensor select(const Tensor& x, int64_t dim, int64_t index);
/// Broadcasts to shape without copying; -1 keeps a size.
Tensor expand(const Tensor& x, const Shape& shape);
/// Removes one size-1 dim, or all of them.
Tensor squeeze(const Tensor& x, std::optional<int64_t> dim = std::nullopt);
Tensor unsqueeze(const Tensor& x, int64_t dim);
/// Joins tensors along an existing dim.
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
/// Joins tensors along a new dim.
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
/// Pieces of `size` along dim (the last may be smaller); views.
std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim = 0);
/// Pieces of the given sizes along dim; they must add up to the dim's size.
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim = 0);
/// `chunks` nearly equal pieces along dim.
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
/// Picks entries along dim by an int32/int64 index vector.
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
/// out[i][j][k] = x[index[i][j][k]][j][k] for dim 0 (likewise for the others), PyTorch's gather:
/// index (int32/int64, negative counts from the end) has x's rank, and no dimension but dim
/// larger than x's. The gradient adds into the picked places (repeats add up).
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
/// gather with the dimensions other than dim broadcast between x and indices (both of one
/// rank), NumPy's take_along_axis: take_along_dim(x, topk(x, k).indices, -1), or one index per
/// row, [B, 1], picked from [B, C].
Tensor take_along_dim(const Tensor& x, const Tensor& indices, int64_t dim);

// ---- neural-network ops -----------------------------------------------------------------

enum class Reduction { Mean, Sum, None };

// The ops below are fused: one kernel pass forward and one backward, saving only what the
// backward needs. They compute in float32 for the reduced-precision dtypes (float64 stays) and
// return the input's floating dtype.

/// Softmax along dim (any dim; along the last one no copy is made).
Tensor softmax(const Tensor& x, int64_t dim = -1);
Tensor log_softmax(const Tensor& x, int64_t dim = -1);
/// logits [N, C] (or [C]), integer class targets [N] (or []); targets equal to ignore_index
/// add nothing, and the mean is over the others (PyTorch's rule). Keeps only the logits and
/// each row's log-sum-exp for backward, never a probability tensor: a GPT's [B*T, vocab]
/// logits cost no second copy.
Tensor cross_entropy(const Tensor& logits, const Tensor& target,
                     Reduction reduction = Reduction::Mean, int64_t ignore_index = -100);
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);
/// Normalizes over the trailing dims given by normalized_shape; weight/bias may be undefined.
/// Saves the input and each row's mean and 1/std.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);
/// Root-mean-square normalization (LLaMA's): x / sqrt(mean(x^2) + eps) * weight over the
/// trailing normalized_shape; weight may be undefined.
Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                double eps = 1e-6);
/// gelu(x + bias) with bias [x.size(-1)], in one pass forward and one backward (the sum z is
/// never stored); tanh_approximation picks gelu_tanh. An undefined bias (a layer without one)
/// is plain gelu / gelu_tanh.
Tensor bias_gelu(const Tensor& x, const Tensor& bias, bool tanh_approximation = false);
/// The gated MLP activations of Llama-class models: silu(gate) * up (SwiGLU) and gelu(gate) *
/// up (GeGLU) for gate_up [..., 2F] holding the gate in its first half and up in its second
/// (the output of one fused projection, so gate and up take one GEMM); returns [..., F]. One
/// pass forward and one per half backward, into one gradient buffer.
Tensor swiglu(const Tensor& gate_up);
Tensor geglu(const Tensor& gate_up, bool tanh_approximation = false);
/// Rows of weight [num, dim] picked by integer indices (any shape) -> [..., dim].
Tensor embedding(const Tensor& weight, const Tensor& indices);
/// In training, zeroes each element with probability p and scales the rest by 1 / (1 - p).
Tensor dropout(const Tensor& x, double p, bool training = true, Generator* generator = nullptr);

// ---- attention ----------------------------------------------------------------------------

struct AttentionOptions {
  /// Each query sees only keys at or before its position. With Tq != Tk the queries are the
  /// last Tq positions (query i sits at i + Tk - Tq): the rule for decoding with a KV cache.
  bool causal = false;
  /// Broadcastable to [B, H, Tq, Tk]: bool (true = may attend) or floating (added to the
  /// scores; differentiated when it requires grad, a learned position bias).
  Tensor mask{};
  /// Multiplies q k^T; 1 / sqrt(head_dim) when unset.
  std::optional<double> scale{};
  /// Dropout on the attention probabilities (applied whenever > 0, as in PyTorch: pass 0 in
  /// evaluation). The mask is drawn from one 64-bit seed taken from `generator` (the default
  /// generator when null) and regenerated in backward, never stored.
  double dropout_p = 0.0;
  Generator* generator = nullptr;
  /// Packed sequences: the document of every key position, int32 or int64, [B, Tk] (or [Tk]
  /// for the whole batch). A query attends only to keys of its own document (on top of the
  /// causal rule and the mask); queries sit at the last Tq positions, as for causal. Key blocks
  /// that share no document with a query block are skipped, not masked, and no Tq x Tk tensor
  /// is formed: the memory of attention without documents.
  Tensor document_ids{};
  /// The queries' documents ([B, Tq] or [Tq]) where they are not the keys' last Tq (context
  /// parallelism's blocks, whose queries and keys come from different parts of the sequence).
  Tensor query_document_ids{};
  /// Sliding window (with causal): each query sees only its `window` latest positions, itself
  /// included (sliding_window of Mistral, Qwen 2 and Gemma's local layers); 0 sees them all.
  /// Key blocks wholly outside every window are skipped.
  int64_t window = 0;
  /// Soft-capped scores (Gemma 2's attn_logit_softcapping): softcap tanh(scale q k^T / softcap)
  /// before the mask; 0 leaves them as they are.
  double softcap = 0.0;
  /// Query 0's position counted from key 0, for the causal rule and the window; unset: Tk - Tq
  /// (the queries are the keys' last positions). Context parallelism's blocks pass the distance
  /// between their chunks.
  std::optional<int64_t> query_start{};
};

/// softmax(scale q k^T + mask) v for q [B, H, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv].
/// Hkv may be any divisor of H (grouped-query attention; 1 is multi-query attention): query
/// head h reads key/value head h / (H / Hkv) where it is, with no repeated copy.
/// Inputs may be strided views, such as a [B, T, H, D] projection transposed to [B, H, T, D]:
/// no copy is made while each has unit stride in its last dim. Fused: it never holds a
/// Tq x Tk tensor (forward keeps each row's log-sum-exp; backward recomputes the scores block
/// by block). The result is laid out [B, Tq, H, Dv] in memory, so `.transpose(1, 2).reshape({B,
/// Tq, H * Dv})` (merging the heads) is free. A query row that may attend to nothing gets 0.
///
///   Tensor qkv = linear(x, w_qkv).reshape({B, T, 3, H, D});   // one fused projection
///   Tensor q = qkv.select(2, 0).transpose(1, 2), ...;           // views, no copies
///   Tensor y = scaled_dot_product_attention(q, k, v, {.causal = true});
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& options = {});

/// scaled_dot_product_attention of q, k and v packed in one tensor qkv [B, T, H, 3, D] (a fused
/// projection's output, reshaped): the same values and gradients as attention on its views
/// qkv.select(3, i).transpose(1, 2), with one gradient buffer for the three instead of one per
/// view. Returns [B, H, T, D].
Tensor packed_qkv_attention(const Tensor& qkv, const AttentionOptions& options = {});

struct AttentionResult {
  Tensor output;
  /// [B, H, Tq] in the computation dtype: log sum_j exp(scores_ij) (+inf for a row that
  /// attends to nothing); not differentiated.
  Tensor logsumexp;
};
/// scaled_dot_product_attention that also returns each row's log-sum-exp (to merge partial
/// attentions over key blocks, as ring attention does).
AttentionResult scaled_dot_product_attention_with_lse(const Tensor& q, const Tensor& k,
                                                      const Tensor& v,
                                                      const AttentionOptions& options = {});

struct AttentionGrads {
  Tensor q, k, v;
};
/// The gradients of scaled_dot_product_attention_with_lse with respect to q, k and v, given
/// `grad` (of the output), the output and its log-sum-exp: for code that computes attention
/// block by block and merges the blocks by their log-sum-exps (ring attention), where no
/// autograd record covers a block. The options are the forward's; a mask is allowed, dropout
/// is not (its mask cannot be regenerated outside the op's own record). Records nothing.
AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad, const Tensor& q,
                                                     const Tensor& k, const Tensor& v,
                                                     const Tensor& output, const Tensor& logsumexp,
                                                     const AttentionOptions& options = {});

/// The keep-mask (bool [B, H, Tq, Tk]) that attention dropout with probability p applies when
/// called with `generator` in the same state (it takes the same one draw from it): to
/// reproduce a run, or to check the fused op against the composed one.
Tensor attention_dropout_mask(const Shape& scores_shape, double p, Generator* generator = nullptr);

// ---- rotary position embeddings -----------------------------------------------------------

/// Llama 3.1's long-context frequency scaling ("rope_scaling": {"rope_type": "llama3"} in a
/// Hugging Face config): frequencies whose wavelength exceeds original_max_position /
/// low_freq_factor are divided by factor, those below original_max_position /
/// high_freq_factor are kept, and the band between is interpolated.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct RotaryOptions {
  /// Frequencies base^(-2i / rotary_dim) for i < rotary_dim / 2 (Llama 2: 10000, Llama 3:
  /// 500000).
  double base = 10000.0;
  /// Which dims turn together: false pairs dim i with i + rotary_dim / 2 (the "rotate_half"
  /// layout of Hugging Face's Llama code and checkpoints); true pairs 2i with 2i + 1 (Meta's
  /// original Llama code, GPT-J).
  bool interleaved = false;
  /// How many leading dims of each head turn (even); the rest pass through unchanged (GPT-NeoX's
  /// partial rotary). 0: all of them.
  int64_t rotary_dim = 0;
  std::optional<Llama3RopeScaling> llama3_scaling{};
  /// Hugging Face's linear rope_scaling (Gemma 3's global layers): every frequency divided by
  /// it, as positions would be; 1: none.
  double linear_factor = 1.0;
};

/// Rotary position embeddings of x [B, T, H, D] at integer positions, [T] or [B, T] (a window
/// packed with several documents restarts its positions at each one): the pair (a, b) with
/// frequency f_i turns by the angle p f_i, to (a cos - b sin, b cos + a sin). Fused: one pass
/// forward and one backward (the inverse turn); x may be a strided view with unit stride in
/// its last dim, such as a fused projection's q before the heads move ahead of T. Angles are
/// formed in float64 whatever x's dtype, so large positions keep their precision.
///
///   Tensor qkv = linear(x, w_qkv).reshape({B, T, 3, H, D});
///   Tensor q = rotary_embedding(qkv.select(2, 0), positions, {.base = 500000}).transpose(1, 2);
Tensor rotary_embedding(const Tensor& x, const Tensor& positions,
                        const RotaryOptions& options = {});
/// The frequencies f_i (float64 [rotary_dim / 2]) that rotary_embedding turns pair i by.
Tensor rotary_frequencies(int64_t rotary_dim, const RotaryOptions& options = {});
/// Positions start .. start + length - 1 (int64, [length]) on `device`: on a GPU a read-only
/// view of a table kept per device, so a model's default positions cost no host-to-device copy
/// after the first call (a step captured in a CUDA graph can make none).
Tensor position_ids(int64_t start, int64_t length, Device device);

// ---- masking and sampling ---------------------------------------------------------------

/// The lower (tril) or upper (triu) triangle of the last two dims: elements with
/// col - row <= diagonal (tril) or >= diagonal (triu) are kept, the rest are 0.
Tensor tril(const Tensor& x, int64_t diagonal = 0);
Tensor triu(const Tensor& x, int64_t diagonal = 0);
/// x with `value` where mask (bool, broadcastable to x's shape) is true.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);

struct TopK {
  Tensor values;   // differentiable (gradient flows to the picked elements)
  Tensor indices;  // int64
};
/// The k largest (or smallest) entries along dim, sorted (ties: the lower index first; NaN
/// counts as largest, as in PyTorch).
TopK topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true);
/// Draws num_samples class indices (int64) from each row of non-negative weights probs [C]
/// or [N, C] (they need not sum to 1); without replacement no index repeats.
Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement = false,
                   Generator* generator = nullptr);

// ---- the differentiable ops, listed -------------------------------------------------------
// The op table (tests/test_op_table.cpp) generates its rows for WEAVE_UNARY_OPS and
// WEAVE_DIFFERENTIABLE_BINARY_OPS and fails for any op in these lists that has no row, so a
// new op cannot go untested: list it here (a unary op: in WEAVE_UNARY_OPS).

/// Binary front ends of the differentiable functors in WEAVE_ARITHMETIC_OPS, in its order.
#define WEAVE_DIFFERENTIABLE_BINARY_OPS(X) X(add) X(sub) X(mul) X(div) X(pow) X(maximum) X(minimum)
/// Every other differentiable op, by the name of its op-table rows.
// clang-format off
#define WEAVE_DIFFERENTIABLE_OTHER_OPS(X)                                                   \
  X(pow_scalar) X(scalar_ops) X(where) X(clamp)                                                   \
  X(sum) X(mean) X(max) X(min) X(var)                                                       \
  X(matmul) X(linear) X(grouped_linear) X(gather_weighted_sum)                              \
  X(reshape) X(view) X(flatten) X(permute) X(transpose) X(narrow) X(slice) X(select)       \
  X(expand) X(squeeze) X(unsqueeze) X(cat) X(stack) X(split) X(chunk) X(index_select)      \
  X(gather) X(take_along_dim)                                                               \
  X(softmax) X(log_softmax) X(cross_entropy) X(mse_loss) X(layer_norm) X(rms_norm)          \
  X(bias_gelu) X(embedding) X(dropout) X(scaled_dot_product_attention) X(tril) X(triu)      \
  X(packed_qkv_attention) X(rotary_embedding) X(swiglu) X(geglu)                           \
  X(masked_fill) X(topk) X(clone) X(contiguous) X(to_dtype) X(add_) X(mul_) X(copy_)
// clang-format on

// ---- comparison of whole tensors --------------------------------------------------------

/// |a - b| <= atol + rtol * |b| everywhere (shapes must broadcast).
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);
/// Same shape and exactly equal values.
bool equal(const Tensor& a, const Tensor& b);

/// Threads used by CPU kernels (OpenMP and Eigen). Set 1 when MPI ranks share cores.
void set_num_threads(int threads);
int num_threads();

/// Precision of float32 matrix products on CUDA, as PyTorch names it: "highest" (the default:
/// float32 throughout) or "high" / "medium" (TF32 tensor cores: inputs rounded to a 10-bit
/// mantissa, float32 accumulation, several times float32's rate on an H100). The CPU always
/// computes float32. Anything else raises.
void set_float32_matmul_precision(const std::string& precision);
std::string float32_matmul_precision();

}  // namespace weave
