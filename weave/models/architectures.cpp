// The one list of the architectures weave reads and writes (data/hf asks for it by
// data::hf::architectures()): a new architecture is a folder here and a line below.
#include "weave/models/architectures.h"

namespace weave::data::hf {

const std::vector<ArchitectureSpec>& architectures() {
  static const std::vector<ArchitectureSpec> all{models::detail::gpt2_architecture(),
                                                 models::detail::llama_architecture()};
  return all;
}

}  // namespace weave::data::hf
