#pragma once
// Hugging Face checkpoints in and out: config.json, model.safetensors or shards with
// model.safetensors.index.json, for GPT-2 (GPT2LMHeadModel) and Llama-family models
// (LlamaForCausalLM, and Qwen2ForCausalLM: Llama with biased q, k and v projections), by the
// parameter names of weave's models (models::GPT2, models::Llama), and back.
//
//   auto config = data::hf::read_config("gpt2/");
//   auto model = models::from_pretrained("gpt2/");   // make_model + load_weights
//   ... fine-tune ...
//   data::hf::save_pretrained(*model, config, "gpt2-tuned/");   // the same names, shapes, dtypes
//
// The layouts differ and are converted exactly (values are copied, never rounded when the
// parameter's dtype holds the file's): GPT-2 stores its linear layers as Conv1D [in, out] and
// c_attn's output as q, k and v side by side, where weave keeps [out, in] with each head's q, k
// and v together; Llama's q/k/v/o and gate/up/down projections map to weave's q, stacked kv,
// out, and stacked gate_up, down. Rotary positions use the rotate-half layout Hugging Face's
// Llama weights expect, with Llama 3's frequency scaling when the config has it.
//
// A model split over ranks (tensor-parallel slices, FSDP's flat shards) loads with
// parallel::load_pretrained, which reads each rank's pieces through a WeightReader.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/data/hf/model_config.h"
#include "weave/data/text/tokenizer.h"
#include "weave/nn/module.h"
#include "weave/ops/ops.h"

namespace weave::data::hf {

/// What a load accepts beyond a checkpoint that matches its config exactly.
struct LoadOptions {
  /// Tensors the config's model does not use (a config with fewer layers than the weights)
  /// are listed in LoadStats::unused instead of raising.
  bool allow_unused = false;
  /// Each value read is checked to be finite; a NaN or infinity raises, naming the tensor and
  /// the element's index (one pass over what the load reads anyway).
  bool check_finite = true;
};

/// The slice of a whole tensor a rank holds: [begin, end) along `axis` (axis -1: all of it).
struct Slice {
  int axis = -1;
  int64_t begin = 0, end = 0;
};

/// A checkpoint's tensors by weave's names for the architecture (models::GPT2's or
/// models::Llama's), whole or in parts, converted to weave's layouts: what load_weights reads for
/// each parameter, for loaders that place values themselves (parallel::load_pretrained reads each
/// rank's tensor-parallel slices and flat-shard ranges through it). Only the bytes asked for are
/// read, give or take a row at each end of an element range (a head's q, k and v rows for
/// GPT-2's c_attn). Values keep the file's dtype. Raises, naming file and tensor: at
/// construction for a missing shard, a tensor the config's model needs that the checkpoint
/// lacks, tensors it holds that the model does not use (unless options.allow_unused; the
/// buffers Hugging Face saved in older files, and a tied model's copy of its head, are
/// ignored), a file the directory names outside itself (an absolute path, "..", or a link out
/// of it; a Hugging Face cache snapshot's links into its blobs/ load) or that is no regular
/// file, and both a model.safetensors and an index (two exports); when reading, for a tensor
/// whose shape the config does not give, a dtype that is not floating point, or a value that
/// is not finite (unless not options.check_finite).
///
///   data::hf::WeightReader reader(config, "llama/");
///   Tensor rows = reader.read("blocks.0.attention.q.weight", {.axis = 0, .begin = 0, .end = 32});
class WeightReader {
 public:
  WeightReader(ModelConfig config, std::string dir, LoadOptions options = {});
  ~WeightReader();
  WeightReader(const WeightReader&) = delete;
  WeightReader& operator=(const WeightReader&) = delete;

  /// The whole shape of tensor `name` as the config gives it; raises for a name it lacks.
  Shape shape(const std::string& name) const;
  /// The slice of tensor `name`.
  Tensor read(const std::string& name, const Slice& slice = {});
  /// Elements [first, first + count) of that slice in row-major order, flat.
  Tensor read_elements(const std::string& name, const Slice& slice, int64_t first, int64_t count);
  /// Bytes read from the safetensors files so far.
  int64_t bytes_read() const;
  /// Lines that tell this checkpoint from another of the same shapes: per safetensors file its
  /// name, size, and checksums of its header and of 32 blocks of 4 KB spread over its data.
  /// Ranks that load one model compare it (parallel::load_pretrained).
  std::string fingerprint() const;
  /// The checkpoint's tensors the config's model does not use (with allow_unused).
  const std::vector<std::string>& unused() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct LoadStats {
  int64_t tensors = 0;     // parameters loaded
  int64_t bytes_read = 0;  // from the safetensors files
  /// The checkpoint's tensors the model does not use (LoadOptions::allow_unused).
  std::vector<std::string> unused;
};

/// Loads dir's weights into model's parameters (whole, by weave's names for the architecture),
/// each in the dtype the parameter has, through a WeightReader. Raises as it does, and for a
/// parameter the architecture lacks or whose shape differs; the model is then partly loaded.
LoadStats load_weights(nn::Module& model, const ModelConfig& config, const std::string& dir,
                       const LoadOptions& options = {});

struct SaveOptions {
  /// Shards of at most this many bytes (a tensor larger than it gets a shard alone); more than
  /// one writes model-0000i-of-0000n.safetensors and model.safetensors.index.json.
  uint64_t max_shard_bytes = uint64_t(5) << 30;
  /// Written beside the weights (Tokenizer::save_pretrained), its special tokens' ids in
  /// config.json and generation_config.json where the config names none.
  const Tokenizer* tokenizer = nullptr;
};

/// weave's names of the architecture's parameters, in the order an export writes them.
std::vector<std::string> parameter_names(const ModelConfig& config);

/// A Hugging Face export written one parameter at a time, so that the writer holds one at a
/// time (parallel::save_pretrained assembles each from the ranks' pieces of a split or sharded
/// model): the parameters come whole, in names()'s order (weave's names for the architecture),
/// in weave's layouts and any dtype and device, and are written in Hugging Face's names,
/// layouts and config.dtype; finish() writes the index, config.json, generation_config.json
/// and the tokenizer's files. The export replaces the directory's model files as one unit
/// (data::StagedDirectory): it is written beside the directory and swapped in at finish(), so a
/// reader or a crash sees the old export whole or the new one whole, and no file of an earlier
/// export (a model.safetensors beside a new index, shards past the new count, weights in
/// PyTorch's format) stays behind; the directory's other files stay. Dropped before finish()
/// (an error), nothing in the directory changes.
///
///   data::hf::PretrainedWriter out(config, "out/");
///   for (const std::string& name : out.names()) out.write(name, whole_value_of(name));
///   out.finish();
class PretrainedWriter {
 public:
  PretrainedWriter(ModelConfig config, std::string dir, SaveOptions options = {});
  ~PretrainedWriter();
  PretrainedWriter(const PretrainedWriter&) = delete;
  PretrainedWriter& operator=(const PretrainedWriter&) = delete;
  /// The parameters, in the order write() takes them.
  const std::vector<std::string>& names() const;
  /// The next parameter, whole; raises for another name, or a shape the config does not give.
  void write(const std::string& name, const Tensor& whole);
  /// After the last parameter.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Whether a directory entry is a model file an export replaces: config.json,
/// generation_config.json, the weights (model.safetensors, its index and shards, and PyTorch's
/// pytorch_model*.bin).
bool is_model_file(const std::string& name);

/// Writes model's whole parameters (a split or sharded model: parallel::save_pretrained) in Hugging
/// Face's names, layouts and config.dtype, with config.json and generation_config.json (the bos and
/// eos ids), and with options.tokenizer its files, into dir (created):
///
///   data::hf::save_pretrained(model, data::hf::model_config(options), "out/",
///                             {.tokenizer = &tokenizer});
void save_pretrained(const nn::Module& model, const ModelConfig& config, const std::string& dir,
                     const SaveOptions& options = {});

}  // namespace weave::data::hf
