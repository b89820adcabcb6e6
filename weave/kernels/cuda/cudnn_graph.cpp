// cudnn_graph.h's planning and execution.
#include "weave/kernels/cuda/cudnn_graph.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "weave/tensor/cuda/device_runtime.h"
#include "weave/tensor/error.h"

namespace weave::kernels::cuda::cudnn {

void check(cudnnStatus_t status, const char* what, int detail) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw Declined{fmt::format("{} ({}): {}", what, detail, cudnnGetErrorString(status))};
}

/// The first engine configuration of cuDNN's heuristics that plans the graph.
std::shared_ptr<Plan> make_plan(GraphBuilder& g, cudnnHandle_t handle) {
  auto result = std::make_shared<Plan>();
  auto graph = std::make_shared<Descriptor>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph
      ->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
            int64_t(g.operations.size()), g.operations.data())
      .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle)
      .finalize();
  result->keep = std::move(g.owned);
  result->keep.push_back(graph);
  std::string reasons;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    auto heuristics = std::make_shared<Descriptor>(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heuristics
        ->set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, graph->get())
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, mode)
        .finalize();
    int64_t count = 0;
    check(cudnnBackendGetAttribute(heuristics->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
          "heuristics", int(mode));
    std::vector<Owned> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      configs.push_back(std::make_shared<Descriptor>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(configs.back()->get());
    }
    check(cudnnBackendGetAttribute(heuristics->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count, raw.data()),
          "heuristics' results", int(mode));
    for (int64_t i = 0; i < count; ++i) {
      try {
        auto plan = std::make_shared<Descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle)
            .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, raw[i])
            .finalize();
        int64_t got = 0;
        check(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                       CUDNN_TYPE_INT64, 1, &got, &result->workspace),
              "workspace size");
        result->plan = plan;
        result->keep.insert(result->keep.end(), configs.begin(), configs.end());
        return result;
      } catch (const Declined& declined) {
        reasons += declined.why + "; ";
      }
    }
  }
  throw Declined{"no engine plans the graph: " + reasons};
}

bool debugging() {
  static const bool on = std::getenv("WEAVE_CUDNN_DEBUG") != nullptr;
  return on;
}

cudnnHandle_t handle_for(int device) {
  static std::mutex mutex;
  static std::map<int, cudnnHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  cudnnHandle_t& handle = handles[device];
  if (!handle) check(cudnnCreate(&handle), "cudnnCreate", device);
  check(cudnnSetStream(handle, static_cast<cudaStream_t>(weave::cuda::stream_handle(device))),
        "cudnnSetStream", device);
  return handle;
}

/// Runs a plan with the named tensors' addresses; scalars are read from the host.
void execute(const Plan& plan, cudnnHandle_t handle, const Device& device,
             const std::vector<std::pair<int64_t, const void*>>& bindings) {
  Tensor workspace =
      empty({std::max<int64_t>(plan.workspace, 1)}, {.dtype = kUInt8, .device = device});
  std::vector<int64_t> uids;
  std::vector<void*> pointers;
  for (const auto& [uid, pointer] : bindings) {
    uids.push_back(uid);
    pointers.push_back(const_cast<void*>(pointer));
  }
  void* space = workspace.data_ptr();
  try {
    Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()),
             uids.data())
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(pointers.size()),
             pointers.data())
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, space)
        .finalize();
    check(cudnnBackendExecute(handle, plan.plan->get(), pack.get()), "execute");
  } catch (const Declined& failed) {
    WEAVE_FAIL("scaled_dot_product_attention", "cuDNN's attention plan failed to run: {}",
               failed.why);
  }
}

}  // namespace weave::kernels::cuda::cudnn
