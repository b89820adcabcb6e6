// CPU elementwise kernels: unary ops and their derivatives, over the typed strided loops of
// loops.h. One translation unit per group of kernels.h's elementwise families: each instantiates
// its loops for every dtype, and apart they build in parallel.
#include "weave/kernels/backends.h"
#include "weave/kernels/common/elementwise.h"
#include "weave/kernels/cpu/loops.h"
#include "weave/kernels/cpu/vector_math.h"

namespace weave::kernels::cpu {

WEAVE_SHARED_UNARY_KERNELS(LoopMap)

}  // namespace weave::kernels::cpu
