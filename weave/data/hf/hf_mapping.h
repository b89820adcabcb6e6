#pragma once
// How weave's parameters of a Hugging Face architecture are made of the checkpoint's tensors
// (internal to weave/data): the names, layouts and shapes that hf_checkpoint.cpp reads by and
// hf_export.cpp writes by.
#include <string>
#include <vector>

#include "weave/data/hf/hf_checkpoint.h"

namespace weave::data::hf::detail {

// How a weave tensor W is made of its Hugging Face sources.
enum class Layout {
  Same,        // W = S
  Transposed,  // W = S^T (GPT-2's Conv1D weights, [in, out])
  Stacked,     // W = stack(S0, S1) (Llama's k/v and gate/up)
  HeadsQKV,    // GPT-2's c_attn: S^T rows (q|k|v, head, d) -> W rows (head, q|k|v, d)
};

struct Mapping {
  std::string weave;
  std::vector<std::string> sources;
  Layout layout;
  std::vector<Shape> shapes;  // the sources', as the config gives them
};

/// The architecture's parameters, in the checkpoint's order.
std::vector<Mapping> mappings(const ModelConfig& config);

/// W's shape: what weave holds of the sources.
Shape weave_shape(const Mapping& m);

/// The file a checkpoint directory names as `entry` (config.json, model.safetensors, an index's
/// shard), resolved inside `dir`: raises, naming the entry, for an absolute path, a ".."
/// component, a link that leads out of the directory (but a Hugging Face cache snapshot's, in
/// <cache>/snapshots/<revision>/, may lead into <cache>/blobs/), or what is no regular file (a
/// folder, a FIFO, a device). A missing file is returned as dir/entry, for the caller to name.
std::string checkpoint_file(const std::string& dir, const std::string& entry);

}  // namespace weave::data::hf::detail
