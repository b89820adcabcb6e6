#include "weave/parallel/checkpoint/pretrained.h"

#include <nlohmann/json.hpp>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/parallel/checkpoint/reshard.h"
#include "weave/parallel/checkpoint/saved_pieces.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/placement.h"
#include "weave/tensor/checksum.h"

namespace weave::parallel {

namespace {

constexpr const char* kLoadPretrainedOp = "load_pretrained";
constexpr const char* kSavePretrainedOp = "save_pretrained";

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

// What a rank read, for the others to compare: the files' fingerprint, and a line per piece
// (which elements of which tensor, and a checksum of their values).
struct ReadRecord {
  std::string fingerprint;
  std::vector<std::string> pieces;
};

data::hf::LoadStats load_parts(nn::Module& model, const data::hf::ModelConfig& config,
                               const std::string& dir, const data::hf::LoadOptions& options,
                               ReadRecord& record) {
  data::hf::WeightReader reader(config, dir, options);
  record.fingerprint = reader.fingerprint();
  // Which elements of which whole tensor each parameter holds: what sharded checkpoints record.
  const std::map<std::string, detail::Pieces> described =
      detail::describe_state({.model = &model, .default_generator = false}).model;
  NoGradGuard no_grad;
  data::hf::LoadStats stats;
  for (auto& [name, param] : model.named_parameters()) {
    const auto pieces = described.find("model/" + name);
    WEAVE_CHECK(pieces != described.end(), kLoadPretrainedOp,
                "{} holds no known part of the model; hint: load the model itself, or its "
                "FullyShardedDataParallel's sharded_module()",
                name);
    nn::materialize_for_overwrite(param);  // a deferred model: the file's values, nothing drawn
    Tensor flat = param.detach().view({param.numel()});
    for (const detail::Piece& piece : pieces->second) {
      const Tensor values = read_piece(reader, name, piece);
      record.pieces.push_back(fmt::format(
          "{} {} axis {} [{}, +{}) elements [{}, +{}) {:08x}", piece.tensor.substr(6), piece.shape,
          piece.axis, piece.begin, piece.length, piece.first, piece.count, checksum(values)));
      flat.narrow(0, piece.offset, piece.count).copy_(values.to(param.dtype()).to(param.device()));
    }
    ++stats.tensors;
  }
  stats.bytes_read = reader.bytes_read();
  stats.unused = reader.unused();
  return stats;
}

// The ranks loaded one checkpoint: the same files (their fingerprints), and where two ranks
// read the same elements, the same values. Raises on every rank otherwise, naming both.
void agree_on_what_was_read(const ReadRecord& record, const std::string& dir,
                            const dist::Group& group) {
  detail::Verdict verdict(kLoadPretrainedOp);
  const std::string hint =
      "hint: every rank loads the same checkpoint (a copy on each host must be byte-identical)";
  verdict.note(detail::lines_disagreement({record.fingerprint}, group,
                                          "the checkpoint files they read from " + dir, hint));
  std::string mine;
  for (const std::string& line : record.pieces) mine += line + '\n';
  // piece -> checksum -> the first rank that read it so
  std::map<std::string, std::map<std::string, int>> read;
  const std::vector<std::string> all = detail::all_gather_bytes(mine, group);
  for (int r = 0; r < group.size(); ++r)
    for (size_t start = 0; start < all[size_t(r)].size();) {
      const size_t end = all[size_t(r)].find('\n', start), space = all[size_t(r)].rfind(' ', end);
      read[all[size_t(r)].substr(start, space - start)].emplace(
          all[size_t(r)].substr(space + 1, end - space - 1), group.global_rank(r));
      start = end + 1;
    }
  for (const auto& [piece, sums] : read)
    if (sums.size() > 1)
      verdict.note(
          fmt::format("ranks {} and {} read different values for {} (checksums {:s} and "
                      "{:s}); {}",
                      sums.begin()->second, std::next(sums.begin())->second, piece,
                      sums.begin()->first, std::next(sums.begin())->first, hint));
  verdict.raise_if_failed();
}

}  // namespace

data::hf::LoadStats load_pretrained(nn::Module& model, const data::hf::ModelConfig& config,
                                    const std::string& dir, const dist::Group& group,
                                    const data::hf::LoadOptions& options) {
  const dist::KeepAlive alive;  // the reads may outlast weave-run's --hang-timeout
  data::hf::LoadStats stats;
  ReadRecord record;
  detail::run_together(kLoadPretrainedOp, group, "load " + dir,
                       [&] { stats = load_parts(model, config, dir, options, record); });
  agree_on_what_was_read(record, dir, group);
  return stats;
}

namespace {

// The whole parameters of a split model (or their gradients), one at a time at group rank 0,
// from the pieces each rank holds (what sharded checkpoints record): prepare() plans the next
// parameter and readies this rank's buffers (what may fail), exchange() moves the elements (what
// may not).
class WholeParameters {
 public:
  enum class Of { Values, Gradients };
  WholeParameters(nn::Module& model, const dist::Group& group, Of of = Of::Values) : group_(group) {
    std::string mine;
    detail::run_together(kSavePretrainedOp, group, "describe its parameters", [&] {
      std::map<std::string, detail::Pieces> pieces =
          detail::describe_state({.model = &model, .default_generator = false}).model;
      nlohmann::json dtypes = nlohmann::json::object();
      const nn::NamedTensors tensors =
          of == Of::Values ? model.state_dict() : model.named_parameters();
      for (const auto& [name, t] : tensors)
        if (pieces.count("model/" + name)) {
          dtypes["model/" + name] = int(t.dtype());
          local_["model/" + name] = of == Of::Values     ? t.detach()
                                    : t.grad().defined() ? t.grad().detach()
                                                         : zeros_like(t);
        }
      std::erase_if(pieces, [&](const auto& entry) { return !local_.count(entry.first); });
      mine = dtypes.dump() + "\n" + detail::pieces_text(pieces);
    });
    const std::vector<std::string> all = detail::all_gather_bytes(mine, group);
    for (int r = 0; r < int(all.size()); ++r) {
      const size_t cut = all[size_t(r)].find('\n');
      const auto dtypes = nlohmann::json::parse(all[size_t(r)].substr(0, cut));
      const std::string source = fmt::format("rank {}", r);
      for (const auto& [name, pieces] :
           detail::parse_pieces(all[size_t(r)].substr(cut + 1), source))
        for (const detail::Piece& piece : pieces)
          held_[piece.tensor].push_back({r, name, DType(dtypes.at(name).get<int>()), piece});
    }
  }

  // The model's tensors held by any rank, by weave's names (the same list on every rank).
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [global, sources] : held_) out.push_back(global.substr(6));  // "model/"
    return out;
  }

  // Plans tensor `name` (weave's parameter name) and readies this rank's part of its exchange.
  void prepare(const std::string& name) {
    const std::string global = "model/" + name;
    const auto held = held_.find(global);
    WEAVE_CHECK(held != held_.end(), kSavePretrainedOp,
                "no rank of group {} holds any part of {}; hint: every rank that holds a part of "
                "the model takes part (the group), with the module that holds its parts (FSDP: "
                "sharded_module())",
                group_.str(), name);
    sources_ = held->second;
    const detail::Piece& first = sources_.front().piece;
    std::vector<std::vector<detail::Run>> runs;
    for (const Source& source : sources_) {
      WEAVE_CHECK(source.piece.shape == first.shape && source.dtype == sources_.front().dtype,
                  kSavePretrainedOp, "rank {} holds {} as a part of a {} {}, rank {} of a {} {}",
                  sources_.front().rank, name, sources_.front().dtype, first.shape, source.rank,
                  source.dtype, source.piece.shape);
      runs.push_back(detail::runs_of(source.piece));
    }
    const detail::Piece want{global, first.shape, -1, 0, 0, 0, first.shape.numel(), 0};
    plan_ = detail::plan_tensor(want, runs);
    int64_t missing = 0;
    for (const detail::Run& run : plan_.missing) missing += run.count;
    WEAVE_CHECK(missing == 0, kSavePretrainedOp,
                "no rank of group {} holds {} of the elements of {} (the first missing is element "
                "{}); hint: every rank that holds a part takes part",
                group_.str(), missing, name, plan_.missing.empty() ? 0 : plan_.missing[0].global);
    whole_ = Tensor(), outgoing_ = Tensor();
    if (group_.rank() == 0) {
      whole_ = empty(first.shape, {.dtype = sources_.front().dtype});
    } else {
      std::vector<Tensor> parts;
      for (const detail::ElementRead& read : reads_of(group_.rank()))
        parts.push_back(elements(read));
      if (!parts.empty()) outgoing_ = parts.size() == 1 ? parts[0] : cat(parts).contiguous();
    }
  }

  // Sends this rank's elements to rank 0, which puts them in place; the whole at rank 0.
  Tensor exchange() {
    if (group_.rank() != 0) {
      if (outgoing_.defined()) dist::send(outgoing_, 0, group_);
      outgoing_ = Tensor();
      return Tensor();
    }
    const Tensor flat = whole_.view({whole_.numel()});
    for (int r = 0; r < group_.size(); ++r) {
      const std::vector<detail::ElementRead> reads = reads_of(r);
      if (reads.empty()) continue;
      if (r == 0) {
        for (const detail::ElementRead& read : reads)
          flat.narrow(0, read.local, read.count).copy_(elements(read));
      } else if (reads.size() == 1) {  // straight into place
        dist::recv(flat.narrow(0, reads[0].local, reads[0].count), r, group_);
      } else {
        int64_t total = 0;
        for (const detail::ElementRead& read : reads) total += read.count;
        const Tensor incoming = empty({total}, {.dtype = whole_.dtype()});
        dist::recv(incoming, r, group_);
        int64_t at = 0;
        for (const detail::ElementRead& read : reads)
          flat.narrow(0, read.local, read.count).copy_(incoming.narrow(0, at, read.count)),
              at += read.count;
      }
    }
    return std::exchange(whole_, Tensor());
  }

 private:
  struct Source {
    int rank;
    std::string tensor;  // its name in the rank's state dict ("model/...")
    DType dtype;
    detail::Piece piece;
  };

  std::vector<detail::ElementRead> reads_of(int rank) const {
    std::vector<detail::ElementRead> out;
    for (const detail::ElementRead& read : plan_.reads)
      if (sources_[read.source].rank == rank) out.push_back(read);
    return out;
  }

  // This rank's elements of a read, on the CPU (a view where they are).
  Tensor elements(const detail::ElementRead& read) const {
    const Tensor& t = local_.at(sources_[read.source].tensor);
    return t.reshape({t.numel()}).narrow(0, read.source_element, read.count).to(kCPU);
  }

  dist::Group group_;
  std::map<std::string, Tensor> local_;              // this rank's, by state-dict name
  std::map<std::string, std::vector<Source>> held_;  // by global tensor, in rank order
  std::vector<Source> sources_;
  detail::TensorPlan plan_;
  Tensor whole_, outgoing_;
};

}  // namespace

void save_pretrained(nn::Module& model, const data::hf::ModelConfig& config, const std::string& dir,
                     const data::hf::SaveOptions& options, const dist::Group& group) {
  NoGradGuard no_grad;
  const dist::KeepAlive alive;  // the writes may outlast weave-run's --hang-timeout
  WholeParameters parameters(model, group);
  const bool writes = group.rank() == 0;
  std::unique_ptr<data::hf::PretrainedWriter> out;
  std::string pending_name;
  Tensor pending;  // the parameter exchanged last, written in the next agreed step
  const auto write_pending = [&] {
    if (!writes) return;
    if (!out) out = std::make_unique<data::hf::PretrainedWriter>(config, dir, options);
    if (pending.defined()) out->write(pending_name, std::exchange(pending, Tensor()));
  };
  for (const std::string& name : data::hf::parameter_names(config)) {
    detail::run_together(kSavePretrainedOp, group, "save " + name + " to " + dir, [&] {
      write_pending();
      parameters.prepare(name);
    });
    pending = parameters.exchange();
    pending_name = name;
  }
  detail::run_together(kSavePretrainedOp, group, "finish " + dir, [&] {
    write_pending();
    if (writes) out->finish();
  });
}

namespace {

nn::NamedTensors gather_whole(nn::Module& model, const dist::Group& group,
                              const std::function<bool(const std::string&)>& keep,
                              WholeParameters::Of of) {
  NoGradGuard no_grad;
  const dist::KeepAlive alive;
  WholeParameters parameters(model, group, of);
  nn::NamedTensors whole;
  for (const std::string& name : parameters.names()) {
    if (keep && !keep(name)) continue;
    detail::run_together(kSavePretrainedOp, group, "gather " + name,
                         [&] { parameters.prepare(name); });
    Tensor value = parameters.exchange();
    if (group.rank() == 0) whole.emplace_back(name, std::move(value));
  }
  return whole;
}

}  // namespace

nn::NamedTensors gather_whole_state_dict(nn::Module& model, const dist::Group& group,
                                         const std::function<bool(const std::string&)>& keep) {
  return gather_whole(model, group, keep, WholeParameters::Of::Values);
}

nn::NamedTensors gather_whole_gradients(nn::Module& model, const dist::Group& group) {
  return gather_whole(model, group, nullptr, WholeParameters::Of::Gradients);
}

}  // namespace weave::parallel
