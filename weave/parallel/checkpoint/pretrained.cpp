#include "weave/parallel/checkpoint/pretrained.h"

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/parallel/checkpoint/saved_pieces.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel {

namespace {

constexpr const char* kLoadPretrainedOp = "load_pretrained";

void check_cuts(const std::string& name, const Tensor& param) {
  if (const Placement* placement = placement_of(param))
    for (const Cut& cut : placement->cuts)
      WEAVE_CHECK(cut.kind != Cut::Kind::Experts, kLoadPretrainedOp,
                  "{} is {}; hint: a Hugging Face checkpoint of GPT-2 or Llama has no experts",
                  name, cut.str());
}

// The elements of the whole tensor that `piece` of parameter `name` holds, in the file's dtype.
Tensor read_piece(data::hf::WeightReader& reader, const std::string& name,
                  const detail::Piece& piece) {
  const std::string whole = piece.tensor.substr(std::string("model/").size());
  WEAVE_CHECK(piece.shape == reader.shape(whole), kLoadPretrainedOp,
              "{} is a part of {} {}, but the checkpoint's config gives {}; hint: is the model "
              "built for this config?",
              name, whole, piece.shape, reader.shape(whole));
  const data::hf::Slice slice{piece.axis, piece.begin, piece.begin + piece.length};
  return reader.read_elements(whole, slice, piece.first, piece.count);
}

data::hf::LoadStats load_parts(nn::Module& model, const data::hf::ModelConfig& config,
                               const std::string& dir) {
  data::hf::WeightReader reader(config, dir);
  // Which elements of which whole tensor each parameter holds: what sharded checkpoints record.
  const std::map<std::string, detail::Pieces> described =
      detail::describe_state({.model = &model, .default_generator = false}).model;
  NoGradGuard no_grad;
  data::hf::LoadStats stats;
  for (auto& [name, param] : model.named_parameters()) {
    check_cuts(name, param);
    const auto pieces = described.find("model/" + name);
    WEAVE_CHECK(pieces != described.end(), kLoadPretrainedOp,
                "{} holds no known part of the model; hint: load the model itself, or its "
                "FullyShardedDataParallel's sharded_module()",
                name);
    nn::materialize_for_overwrite(param);  // a deferred model: the file's values, nothing drawn
    Tensor flat = param.detach().view({param.numel()});
    for (const detail::Piece& piece : pieces->second) {
      const Tensor values = read_piece(reader, name, piece);
      flat.narrow(0, piece.offset, piece.count).copy_(values.to(param.dtype()).to(param.device()));
    }
    ++stats.tensors;
  }
  stats.bytes_read = reader.bytes_read();
  return stats;
}

}  // namespace

data::hf::LoadStats load_pretrained(nn::Module& model, const data::hf::ModelConfig& config,
                                    const std::string& dir, const dist::Group& group) {
  data::hf::LoadStats stats;
  detail::run_together(kLoadPretrainedOp, group, "load " + dir,
                       [&] { stats = load_parts(model, config, dir); });
  return stats;
}

}  // namespace weave::parallel
