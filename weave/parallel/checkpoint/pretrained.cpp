#include "weave/parallel/checkpoint/pretrained.h"

#include "weave/parallel/core/placement.h"

namespace weave::parallel {

data::hf::LoadStats load_pretrained(nn::Module& model, const data::hf::ModelConfig& config,
                                    const std::string& dir) {
  const std::map<std::string, TensorSplit> splits = tensor_splits(model);
  return data::hf::load_weights(
      model, config, dir, [&](const std::string& name, const Tensor& param) {
        if (const Placement* placement = placement_of(param))
          for (const Cut& cut : placement->cuts)
            WEAVE_CHECK(cut.kind == Cut::Kind::Split || cut.kind == Cut::Kind::Stage,
                        "load_pretrained",
                        "{} is {}; hint: load the whole model, then wrap it (FSDP, ZeRO) or "
                        "spread its experts",
                        name, cut.str());
        const auto split = splits.find(name);
        if (split == splits.end()) return data::hf::Slice{};
        const int axis = split->second.axis;
        const int64_t piece = param.size(axis);
        return data::hf::Slice{axis, piece * split->second.index,
                               piece * (split->second.index + 1)};
      });
}

}  // namespace weave::parallel
