// The MPI backend's datatypes and reduction ops: 16-bit floats as 2-byte types reduced in
// float, and the mean of two ranks in one pass.
#include "weave/distributed/mpi/mpi_types.h"

#include <type_traits>

#include "weave/tensor/dtype.h"

namespace weave::dist::detail {

namespace {

// 16-bit floats travel as 2-byte types of their own, reduced by our ops in float.
MPI_Datatype half_type = MPI_DATATYPE_NULL, bfloat16_type = MPI_DATATYPE_NULL;
MPI_Op half_ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum prod min max

template <class T, int Which>
void reduce_16bit(void* in, void* inout, int* length, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *length; ++i) {
    float x = float(a[i]), y = float(b[i]);
    float r = Which == 0   ? x + y
              : Which == 1 ? x * y
              : Which == 2 ? (x < y ? x : y)
                           : (x > y ? x : y);
    b[i] = T(r);
  }
}

template <int Which>
void reduce_16bit_dispatch(void* in, void* inout, int* length, MPI_Datatype* type) {
  if (*type == half_type)
    reduce_16bit<Half, Which>(in, inout, length, type);
  else
    reduce_16bit<BFloat16, Which>(in, inout, length, type);
}

// The mean of two ranks' values, as one reduction: (a + b) / 2 is exact where sum-then-halve
// is, and saves a pass over the result. Only for communicators of two ranks, where MPI applies
// the op exactly once per element whatever its algorithm.
MPI_Op mean_of_two = MPI_OP_NULL;

template <class T>
void mean_of_two_typed(void* in, void* inout, int length) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  for (int i = 0; i < length; ++i) b[i] = T((C(a[i]) + C(b[i])) * C(0.5));
}

void mean_of_two_dispatch(void* in, void* inout, int* length, MPI_Datatype* type) {
  if (*type == MPI_FLOAT)
    mean_of_two_typed<float>(in, inout, *length);
  else if (*type == MPI_DOUBLE)
    mean_of_two_typed<double>(in, inout, *length);
  else if (*type == half_type)
    mean_of_two_typed<Half>(in, inout, *length);
  else
    mean_of_two_typed<BFloat16>(in, inout, *length);
}

}  // namespace

void create_16bit_types() {
  if (half_type != MPI_DATATYPE_NULL) return;
  WEAVE_CHECK_CALL(MPI_Type_contiguous(2, MPI_BYTE, &half_type), "init");
  WEAVE_CHECK_CALL(MPI_Type_commit(&half_type), "init");
  WEAVE_CHECK_CALL(MPI_Type_contiguous(2, MPI_BYTE, &bfloat16_type), "init");
  WEAVE_CHECK_CALL(MPI_Type_commit(&bfloat16_type), "init");
  WEAVE_CHECK_CALL(MPI_Op_create(reduce_16bit_dispatch<0>, 1, &half_ops[0]), "init");
  WEAVE_CHECK_CALL(MPI_Op_create(reduce_16bit_dispatch<1>, 1, &half_ops[1]), "init");
  WEAVE_CHECK_CALL(MPI_Op_create(reduce_16bit_dispatch<2>, 1, &half_ops[2]), "init");
  WEAVE_CHECK_CALL(MPI_Op_create(reduce_16bit_dispatch<3>, 1, &half_ops[3]), "init");
  WEAVE_CHECK_CALL(MPI_Op_create(mean_of_two_dispatch, 1, &mean_of_two), "init");
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case kFloat32:
      return MPI_FLOAT;
    case kFloat64:
      return MPI_DOUBLE;
    case kInt32:
      return MPI_INT32_T;
    case kInt64:
      return MPI_INT64_T;
    case kUInt8:
      return MPI_UINT8_T;
    case kBool:
      return MPI_C_BOOL;
    case kFloat16:
      return half_type;
    case kBFloat16:
      return bfloat16_type;
  }
  WEAVE_FAIL("mpi", "unsupported dtype {}", dtype);
}

MPI_Op mpi_op(ReduceOp op, DType dtype) {
  const int index = op == ReduceOp::Sum    ? 0
                    : op == ReduceOp::Prod ? 1
                    : op == ReduceOp::Min  ? 2
                                           : 3;
  if (dtype == kFloat16 || dtype == kBFloat16) return half_ops[index];
  if (dtype == kBool) return (index == 0 || index == 3) ? MPI_LOR : MPI_LAND;  // any / all
  const MPI_Op ops[] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};
  return ops[index];
}

MPI_Op mean_of_two_op() {
  return mean_of_two;
}

}  // namespace weave::dist::detail
