#pragma once
// cuDNN's backend (graph) API, the little of it weave uses: descriptors that destroy themselves,
// a builder of operation graphs (tensors, pointwise operations, reductions, matmuls, reshapes),
// plans from cuDNN's heuristics, and their execution on weave's stream. A graph cuDNN cannot
// plan raises Declined, so that the caller can fall back to weave's own kernels.
#include <cudnn.h>

#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "weave/tensor/tensor.h"

namespace weave::kernels::cuda::cudnn {

/// Raised while a graph is built or planned: cuDNN declines the shape (weave's kernels run it).
struct Declined {
  std::string why;
};

/// Raises Declined where status is not success.
void check(cudnnStatus_t status, const char* what, int detail = 0);

/// One backend descriptor, destroyed with its owner.
class Descriptor {
 public:
  explicit Descriptor(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &raw_), "create descriptor", int(type));
  }
  ~Descriptor() {
    if (raw_) cudnnBackendDestroyDescriptor(raw_);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  cudnnBackendDescriptor_t get() const { return raw_; }
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
                  const void* values) {
    check(cudnnBackendSetAttribute(raw_, name, type, count, values), "set attribute", int(name));
    return *this;
  }
  template <class T>
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                  const T& value) {
    return set(name, type, 1, &value);
  }
  Descriptor& finalize() {
    check(cudnnBackendFinalize(raw_), "finalize");
    return *this;
  }

 private:
  cudnnBackendDescriptor_t raw_ = nullptr;
};
using Owned = std::shared_ptr<Descriptor>;
using Shape = std::array<int64_t, 4>;

inline Shape contiguous(Shape dims) {
  return {dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1};
}

class GraphBuilder {
 public:
  cudnnBackendDescriptor_t tensor(int64_t uid, Shape dims, Shape strides, cudnnDataType_t type,
                                  bool is_virtual = false, bool by_value = false) {
    auto t = own(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    t->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data())
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data())
        .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid)
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, alignment)
        .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, is_virtual);
    if (by_value) t->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, true);
    return t->finalize().get();
  }
  /// A float scalar passed by value at execution.
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, false, true);
  }
  cudnnBackendDescriptor_t intermediate(Shape dims, cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    return intermediate(dims, contiguous(dims), type);
  }
  cudnnBackendDescriptor_t intermediate(Shape dims, Shape strides, cudnnDataType_t type) {
    return tensor(next_uid_++, dims, strides, type, true);
  }

  /// y = mode(x[, b[, t]]), computed in `math`.
  cudnnBackendDescriptor_t pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t y,
                                     cudnnBackendDescriptor_t x,
                                     cudnnBackendDescriptor_t b = nullptr,
                                     cudnnBackendDescriptor_t t = nullptr,
                                     cudnnDataType_t math = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto pw = own(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, mode)
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, math);
    if (axis >= 0) pw->set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, axis);
    const cudnnBackendDescriptor_t pw_raw = pw->finalize().get();
    auto op = own(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    const float one = 1.f;
    op->set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, pw_raw)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, x)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, y)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, one)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, one);
    if (b) op->set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, b);
    if (t) op->set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, t);
    add(op);
    return y;
  }
  cudnnBackendDescriptor_t reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t y,
                                     cudnnBackendDescriptor_t x) {
    auto r = own(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    r->set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT)
        .set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, mode);
    const cudnnBackendDescriptor_t r_raw = r->finalize().get();
    auto op = own(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op->set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, r_raw)
        .set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, x)
        .set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, y);
    add(op);
    return y;
  }
  /// c = a @ b over the last two dimensions.
  cudnnBackendDescriptor_t matmul(cudnnBackendDescriptor_t c, cudnnBackendDescriptor_t a,
                                  cudnnBackendDescriptor_t b) {
    auto m = own(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    m->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
    const cudnnBackendDescriptor_t m_raw = m->finalize().get();
    auto op = own(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op->set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, a)
        .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, b)
        .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, c)
        .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, m_raw);
    add(op);
    return c;
  }
  /// y views x's elements with other dimensions or strides (a transpose, here).
  cudnnBackendDescriptor_t reshape(cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t x) {
    auto op = own(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op->set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, x)
        .set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, y);
    add(op);
    return y;
  }
  std::vector<Owned> owned;
  std::vector<cudnnBackendDescriptor_t> operations;

 private:
  Owned own(cudnnBackendDescriptorType_t type) {
    owned.push_back(std::make_shared<Descriptor>(type));
    return owned.back();
  }
  void add(const Owned& op) { operations.push_back(op->finalize().get()); }
  int64_t next_uid_ = 1000;  // intermediates; the caller names its tensors below
};

/// A graph's execution plan, with the descriptors it was built from.
struct Plan {
  std::vector<Owned> keep;
  Owned plan;
  int64_t workspace = 0;
  bool accumulates_dq = false;
};

/// The first engine configuration of cuDNN's heuristics that plans the graph (Declined if none).
std::shared_ptr<Plan> make_plan(GraphBuilder& g, cudnnHandle_t handle);
/// WEAVE_CUDNN_DEBUG is set: say why graphs are declined.
bool debugging();
/// The device's handle, on weave's stream of that device.
cudnnHandle_t handle_for(int device);
/// Runs a plan with the named tensors' addresses (scalars: host addresses) and a workspace.
void execute(const Plan& plan, cudnnHandle_t handle, const Device& device,
             const std::vector<std::pair<int64_t, const void*>>& bindings);

}  // namespace weave::kernels::cuda::cudnn
