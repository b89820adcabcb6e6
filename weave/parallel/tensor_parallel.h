#pragma once
// Moved: weave 0.2 placed this header at weave/parallel/model_parallel/tensor_parallel.h, when
// parallel/ gained its floors (core, data_parallel, model_parallel, checkpoint). This one only
// forwards there, for the 0.2 release; it goes away after it. Include the new path, or
// weave/weave.h.
#include "weave/parallel/model_parallel/tensor_parallel.h"
#include "weave/parallel/model_parallel/tensor_parallel_vocabulary.h"
