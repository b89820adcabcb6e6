// safetensors files (against the format's byte layout, and every kind of corruption) and
// training checkpoints (exact resume, strict all-or-nothing loads).
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>

#include <zlib.h>

#include "helpers.h"

using namespace weave;
using weave::test::error_of;

namespace {

std::filesystem::path scratch_dir() {
  auto dir = std::filesystem::temp_directory_path() /
             ("weave_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(std::rand()));
  std::filesystem::create_directories(dir);
  return dir;
}

// A field of /proc/self/status in kB (VmRSS: resident now, VmHWM: the resident peak).
int64_t status_kb(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

// Restarts VmHWM from the resident size now; false where the kernel does not allow it.
bool reset_peak_resident() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.close();
  return bool(clear);
}

std::string little_endian_u64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// A file image built by hand from the format description, header keys in the order the Python
// package writes them.
std::string hand_made_file() {
  std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"I64","shape":[1],"data_offsets":[8,16]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string data;
  const float a[2] = {1.5f, -2.0f};
  const int64_t b = 42;
  data.append(reinterpret_cast<const char*>(a), 8);
  data.append(reinterpret_cast<const char*>(&b), 8);
  return little_endian_u64(header.size()) + header + data;
}

// A model with every kind of state: parameters, a buffer-free dropout drawing from the default
// generator, so an exact resume needs the generator too.
struct Net : nn::Module {
  Net() : nn::Module("Net") {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(6, 16));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(16, 3));
  }
  Tensor forward(const Tensor& x) override {
    return fc2->forward(dropout(relu(fc1->forward(x)), 0.2, is_training()));
  }
  std::shared_ptr<nn::Linear> fc1, fc2;
};

std::shared_ptr<data::TensorDataset> toy_data() {
  Generator g(11);
  Tensor x = randn({40, 6}, {}, &g);
  Tensor y = argmax(matmul(x, randn({6, 3}, {}, &g)), 1);
  return std::make_shared<data::TensorDataset>(x, y);
}

// One run: builds everything from seed 0, optionally loads `resume_from`, trains `epochs`
// epochs (or stops after `stop_after_batches` batches), optionally saves; returns the losses.
std::vector<float> train(bool adam, int epochs, const std::string& resume_from = "",
                         const std::string& save_to = "", int stop_after_batches = -1) {
  manual_seed(0);
  Net net;
  std::unique_ptr<optim::Optimizer> opt;
  if (adam)
    opt = std::make_unique<optim::AdamW>(net.parameters(), optim::AdamWOptions{.lr = 0.01});
  else
    opt = std::make_unique<optim::SGD>(net.parameters(),
                                       optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  optim::LRScheduler sched(*opt, optim::cosine_schedule(adam ? 0.01 : 0.05, 40));
  data::DataLoader loader(toy_data(), {.batch_size = 8, .shuffle = true, .seed = 5});
  data::TrainingState state{
      .model = &net, .optimizer = opt.get(), .scheduler = &sched, .loader = &loader};
  if (!resume_from.empty()) data::load_checkpoint(resume_from, state);
  std::vector<float> losses;
  int batches = 0;
  for (int e = 0; e < epochs; ++e) {
    for (const auto& batch : loader) {
      opt->zero_grad();
      Tensor loss = cross_entropy(net(batch.input), batch.target);
      loss.backward();
      opt->step();
      sched.step();
      losses.push_back(loss.item<float>());
      if (++batches == stop_after_batches) break;
    }
    if (batches == stop_after_batches) break;
  }
  if (!save_to.empty()) data::save_checkpoint(save_to, state);
  return losses;
}

}  // namespace

TEST_SUITE("checkpoint") {
  TEST_CASE("safetensors: the byte layout of the format, both ways") {
    const auto file =
        data::parse_safetensors(hand_made_file().data(), hand_made_file().size(), "hand-made");
    REQUIRE(file.tensors.size() == 2);
    CHECK(file.tensors[0].first == "a");  // file order: by offset
    CHECK(file.tensors[0].second.to_vector<float>() == std::vector<float>{1.5f, -2.0f});
    CHECK(file.tensors[1].second.dtype() == kInt64);
    CHECK(file.tensors[1].second.to_vector<int64_t>() == std::vector<int64_t>{42});
    CHECK(file.metadata.at("format") == "pt");

    // Writing: length, the JSON header padded with spaces to 8 bytes, then the raw bytes.
    const std::string image =
        data::serialize_safetensors({{"w", from_vector<float>({1, 2})}}, {{"step", "3"}});
    // weave adds CRC-32s (zlib's, computed here independently): of w's 8 bytes, of each
    // 64 KiB block of the data (here one, the same 8 bytes), and of the other metadata as
    // "key\0value\0" pairs in key order.
    const float w[2] = {1, 2};
    const auto crc_w = ::crc32_z(0, reinterpret_cast<const Bytef*>(w), 8);
    const std::string blocks = fmt::format("65536 {:08x}", crc_w);
    const std::string pairs = std::string(
                                  "step\0"
                                  "3\0"
                                  "weave.crc32/blocks\0",
                                  26) +
                              blocks + std::string(1, '\0');
    const auto crc_meta = ::crc32_z(0, reinterpret_cast<const Bytef*>(pairs.data()), pairs.size());
    const std::string header = fmt::format(
        R"({{"__metadata__":{{"step":"3","weave.crc32.w":"{:08x}","weave.crc32/blocks":"{}",)"
        R"("weave.crc32/metadata":"{:08x}"}},)"
        R"("w":{{"data_offsets":[0,8],"dtype":"F32","shape":[2]}}}})",
        crc_w, blocks, crc_meta);
    const std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');
    CHECK(image == little_endian_u64(padded.size()) + padded +
                       std::string(reinterpret_cast<const char*>(w), 8));
  }

  TEST_CASE("safetensors: every dtype, empty and 0-d tensors round-trip") {
    nn::NamedTensors tensors;
    for (DType d : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool})
      tensors.emplace_back(std::string("t_") + dtype_name(d),
                           from_vector<float>({0, 1, 1, 0, 1, 0}).reshape({2, 3}).to(d));
    tensors.emplace_back("empty", zeros({0, 4}));
    tensors.emplace_back("scalar", scalar_tensor(7.25));
    tensors.emplace_back("strided", arange(12).reshape({3, 4}).t());  // written contiguous
    auto dir = scratch_dir();
    const std::string path = (dir / "all.safetensors").string();
    data::save_safetensors(path, tensors, {{"note", "ok"}});
    auto back = data::load_safetensors(path);
    REQUIRE(back.tensors.size() == tensors.size());
    std::map<std::string, Tensor> by_name(back.tensors.begin(), back.tensors.end());
    for (const auto& entry : tensors) {
      const std::string& name = entry.first;  // CAPTURE needs a variable, not a binding
      const Tensor& t = entry.second;
      CAPTURE(name);
      const Tensor& b = by_name.at(name);
      CHECK(b.dtype() == t.dtype());
      CHECK(b.shape() == t.shape());
      CHECK(b.to(kFloat64).to_vector<double>() == t.to(kFloat64).to_vector<double>());
    }
    CHECK(back.metadata.at("note") == "ok");
    // nothing but the file itself is left in the directory (the temporary was renamed)
    CHECK(std::distance(std::filesystem::directory_iterator(dir),
                        std::filesystem::directory_iterator()) == 1);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("safetensors: the streaming writer writes serialize_safetensors' bytes") {
    // A transposed float64 view written as float32 (18 MB: converted in 16 MB pieces), a
    // bfloat16 tensor as it is, and a 0-d one: the same file as the whole image, byte for byte.
    Generator g(3);
    const Tensor big = randn({2100, 1100}, {.dtype = kFloat64}, &g);
    const Tensor half = randn({5, 7}, {}, &g).to(kBFloat16);
    const nn::NamedTensors whole{
        {"big", big.t().to(kFloat32).contiguous()}, {"half", half}, {"scalar", scalar_tensor(2.5)}};
    auto dir = scratch_dir();
    const std::string path = (dir / "streamed.safetensors").string();
    {
      data::SafetensorsWriter out(
          path,
          {{"big", kFloat32, {1100, 2100}}, {"half", kBFloat16, {5, 7}}, {"scalar", kFloat32, {}}},
          {{"epoch", "1"}});
      out.write(big.t());
      out.write(half);
      CHECK_WEAVE_ERROR(out.write(ones({2})), "safetensors", "declared");
      out.write(scalar_tensor(2.5));
      CHECK_WEAVE_ERROR(out.write(ones({})), "safetensors", "written already");
      out.commit();
    }
    CHECK(data::read_file(path) == data::serialize_safetensors(whole, {{"epoch", "1"}}));
    {  // dropped before commit: the file stays as it was, and no temporary is left
      data::SafetensorsWriter out(path, {{"x", kFloat32, {2}}});
      out.write(ones({2}));
    }
    {
      data::SafetensorsWriter out(path, {{"x", kFloat32, {2}}, {"y", kFloat32, {1}}});
      out.write(ones({2}));
      CHECK_WEAVE_ERROR(out.commit(), "safetensors", "1 of 2 tensors were written");
    }
    CHECK(data::read_file(path) == data::serialize_safetensors(whole, {{"epoch", "1"}}));
    CHECK(std::distance(std::filesystem::directory_iterator(dir),
                        std::filesystem::directory_iterator()) == 1);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("safetensors: corrupt files are errors that name the problem") {
    auto parse = [](const std::string& bytes) {
      return error_of([&] { data::parse_safetensors(bytes.data(), bytes.size(), "f"); });
    };
    const std::string good = hand_made_file();
    // every truncation of a valid file is an error, never a crash
    for (size_t n = 0; n < good.size(); ++n) {
      CAPTURE(n);
      CHECK_FALSE(parse(good.substr(0, n)).empty());
    }
    CHECK(parse(good + "x").find("holds 1 bytes of data after") != std::string::npos);
    auto with_header = [](const std::string& header, const std::string& data) {
      return little_endian_u64(header.size()) + header + data;
    };
    const std::string eight(8, '\0');
    CHECK(parse(little_endian_u64(uint64_t(1) << 62) + "{}").find("declares a") !=
          std::string::npos);
    CHECK(parse(with_header("[1, 2]", "")).find("not a JSON object") != std::string::npos);
    CHECK(parse(with_header("{not json", "")).find("not a JSON object") != std::string::npos);
    CHECK(parse(with_header(R"({"a":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}})", "x"))
              .find("dtype 'F8'") != std::string::npos);
    CHECK(parse(with_header(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight))
              .find("F32 [3] needs 12") != std::string::npos);
    CHECK(parse(with_header(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
                            eight.substr(0, 4)))
              .find("not a non-negative integer") != std::string::npos);
    CHECK(parse(with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
                            eight))
              .find("without overlaps or holes") != std::string::npos);
    CHECK(parse(with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight))
              .find("starts at byte 4") != std::string::npos);
    CHECK(parse(with_header(R"({"a":{"dtype":"BOOL","shape":[1],"data_offsets":[0,1]}})",
                            std::string(1, '\2')))
              .find("holds the byte 2") != std::string::npos);
    CHECK(parse(with_header(R"({"__metadata__":{"k":1}})", ""))
              .find("metadata 'k' is not a string") != std::string::npos);
    CHECK(parse(with_header(R"({"__metadata__":[1]})", "")).find("__metadata__ is not an object") !=
          std::string::npos);
    CHECK(parse(with_header(R"({"a":[0,4]})", "")).find("'a' has a header entry that is not") !=
          std::string::npos);
    CHECK(parse(with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                            R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                            eight))
              .find("tensor name 'a' appears twice") != std::string::npos);
    CHECK(parse(with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],)"
                            R"("x":{"y":1},"z":[true]}})",
                            eight.substr(0, 4)))
              .empty());  // fields weave does not know are skipped, nested or not
    CHECK(parse(with_header(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4],)"
                            R"("data_offsets":[0,0]}})",
                            ""))
              .find("overflows") != std::string::npos);
    CHECK_WEAVE_ERROR(data::load_safetensors("/nonexistent/x.safetensors"), "safetensors",
                      "cannot open");
    CHECK_WEAVE_ERROR(data::serialize_safetensors({{"a", ones({1})}, {"a", ones({1})}}),
                      "safetensors", "appears twice");
  }

  TEST_CASE("safetensors: 300 random bit flips anywhere in a file are all rejected") {
    nn::NamedTensors tensors{{"w", randn({16, 8})},
                             {"b", arange(5.0, {.dtype = kInt64})},
                             {"h", randn({3, 3}).to(kBFloat16)}};
    const std::string image = data::serialize_safetensors(tensors, {{"epoch", "3"}});
    const auto clean = data::parse_safetensors(image.data(), image.size(), "clean");
    CHECK(clean.metadata == data::Metadata{{"epoch", "3"}});  // the checksums stay inside
    std::mt19937_64 rng(2026);
    int rejected = 0;
    for (int trial = 0; trial < 300; ++trial) {
      std::string bad = image;
      const size_t byte = rng() % bad.size();
      bad[byte] = static_cast<char>(bad[byte] ^ (1 << (rng() % 8)));
      const std::string error =
          error_of([&] { data::parse_safetensors(bad.data(), bad.size(), "flipped"); });
      if (!error.empty()) {
        ++rejected;
      } else {
        MESSAGE("a flip of byte " << byte << " of " << bad.size() << " loaded silently");
      }
    }
    CHECK(rejected == 300);
    // Tensor bytes and metadata values are covered by the checksums, not just the layout.
    std::string bad = image;
    bad[bad.size() - 1] ^= 1;
    CHECK(error_of([&] {
            data::parse_safetensors(bad.data(), bad.size(), "f");
          }).find("fails its checksum") != std::string::npos);
    bad = image;
    bad[image.find("\"3\"") + 1] = '4';  // epoch 3 -> 4
    CHECK(error_of([&] {
            data::parse_safetensors(bad.data(), bad.size(), "f");
          }).find("the metadata fails its checksum") != std::string::npos);
  }

  TEST_CASE("safetensors: a crafted header is rejected before the parser allocates") {
    // A 99 MB header of nested arrays (the format's limit is 100 MB).
    const size_t depth = 99u << 20;
    std::string header(depth / 2, '[');
    header.append(depth / 2, ']');
    std::string file = little_endian_u64(header.size()) + header;
    const auto start = std::chrono::steady_clock::now();
    const std::string error =
        error_of([&] { data::parse_safetensors(file.data(), file.size(), "nested"); });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(error.find("nests deeper than 3 levels at byte 11") != std::string::npos);
    CHECK(seconds < 1.0);
    // A shape of a million sizes.
    std::string shape = R"({"a":{"dtype":"F32","shape":[)";
    for (int i = 0; i < 1000000; ++i) shape += "1,";
    shape += R"(1],"data_offsets":[0,4]}})";
    file = little_endian_u64(shape.size()) + shape + std::string(4, '\0');
    CHECK(error_of([&] {
            data::parse_safetensors(file.data(), file.size(), "wide");
          }).find("an array of more than 8 elements") != std::string::npos);
    CHECK(error_of([&] {
            data::serialize_safetensors({{"a", ones({1})}}, {{"weave.crc32.a", "x"}});
          }).find("is reserved") != std::string::npos);
  }

  TEST_CASE("safetensors: a header of a million entries reads in memory bounded by its size") {
    const int n = 1 << 20;
    std::string header = "{";
    header.reserve(size_t(n) * 64);
    for (int i = 0; i < n; ++i)
      header += fmt::format(R"({}"t{:07}":{{"dtype":"U8","shape":[1],"data_offsets":[{},{}]}})",
                            i ? "," : "", i, i, i + 1);
    header += "}";
    const auto dir = scratch_dir();
    const std::string path = (dir / "wide.safetensors").string();
    {
      std::ofstream out(path, std::ios::binary);
      out << little_endian_u64(header.size()) << header << std::string(size_t(n), '\0');
    }
    const double header_bytes = double(header.size());
    std::string().swap(header);
#if defined(__SANITIZE_ADDRESS__)
    const bool measurable = false;  // redzones and a quarantine of freed memory: not the library's
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
    const bool measurable = false;
#else
    const bool measurable = true;
#endif
#else
    const bool measurable = true;
#endif
    if (!measurable) {
      CHECK(data::read_safetensors_header(path).entries.size() == size_t(n));
      std::filesystem::remove_all(dir);
      return;
    }
    if (!reset_peak_resident()) {
      MESSAGE("/proc/self/clear_refs is not writable here; the memory bound is not measured");
      return;
    }
    const int64_t before_kb = status_kb("VmRSS");
    const data::SafetensorsHeader read = data::read_safetensors_header(path);
    const double used = double(status_kb("VmHWM") - before_kb) * 1024;
    CHECK(read.entries.size() == size_t(n));
    CHECK(read.entries.back().name == "t1048575");
    // The header's own bytes (read whole) and one compact entry per tensor: a JSON document of
    // the header, node by node, costs about 16 times its bytes.
    CHECK_MESSAGE(used < 4 * header_bytes,
                  "reading a " << header_bytes / 1e6 << " MB header took " << used / 1e6 << " MB");
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("exact resume: 2 epochs, save, 2 more == 4 uninterrupted (SGD and AdamW)") {
    auto dir = scratch_dir();
    for (bool adam : {false, true}) {
      CAPTURE(adam);
      const std::string path = (dir / (adam ? "adamw.safetensors" : "sgd.safetensors")).string();
      const std::vector<float> straight = train(adam, 4);
      const std::vector<float> first = train(adam, 2, "", path);
      const std::vector<float> second = train(adam, 2, path);
      std::vector<float> joined = first;
      joined.insert(joined.end(), second.begin(), second.end());
      REQUIRE(joined.size() == straight.size());
      for (size_t i = 0; i < straight.size(); ++i) {
        CAPTURE(i);
        CHECK(joined[i] == straight[i]);  // bit-identical, not approximately equal
      }
      // and in the middle of an epoch: 7 batches, save, the rest
      const std::vector<float> part = train(adam, 4, "", path, 7);
      const std::vector<float> rest = train(adam, 4, path, "", int(straight.size()) - 7);
      std::vector<float> mid = part;
      mid.insert(mid.end(), rest.begin(), rest.end());
      CHECK(mid == straight);
    }
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("strict loads: a mismatch names the tensor and changes nothing") {
    auto dir = scratch_dir();
    const std::string path = (dir / "net.safetensors").string();
    manual_seed(1);
    Net saved;
    optim::AdamW opt(saved.parameters(), {.lr = 0.01});
    data::TrainingState state{.model = &saved, .optimizer = &opt};
    data::save_checkpoint(path, state);

    manual_seed(2);
    Net other;
    optim::AdamW other_opt(other.parameters(), {.lr = 0.5});
    const Tensor before = other.fc1->weight.clone();
    // an optimizer whose state came from more steps than the file's: AdamW's "step" is 0 there
    data::TrainingState target{.model = &other, .optimizer = &other_opt};

    auto file = data::load_safetensors(path);
    auto rewrite = [&](const std::function<void(data::SafetensorsFile&)>& edit) {
      data::SafetensorsFile copy = file;
      edit(copy);
      data::save_safetensors(path, copy.tensors, copy.metadata);
    };
    rewrite([](auto& f) { f.tensors[0].second = zeros({5, 5}); });
    CHECK_WEAVE_ERROR(data::load_checkpoint(path, target), "load_checkpoint",
                      "[5, 5] in the state dict");
    rewrite([](auto& f) { f.tensors[0].second = f.tensors[0].second.to(kFloat64); });
    CHECK_WEAVE_ERROR(data::load_checkpoint(path, target), "load_checkpoint", "float64");
    rewrite([](auto& f) { f.tensors[0].first = "model/fc9.weight"; });
    CHECK_WEAVE_ERROR(data::load_checkpoint(path, target), "load_checkpoint", "fc9.weight");
    rewrite([](auto& f) { f.tensors.erase(f.tensors.begin()); });
    CHECK_WEAVE_ERROR(data::load_checkpoint(path, target), "load_checkpoint", "missing key");
    rewrite([](auto& f) { f.metadata.erase("optimizer"); });
    CHECK_WEAVE_ERROR(data::load_checkpoint(path, target), "load_checkpoint", "'optimizer'");
    rewrite([](auto& f) { f.tensors.emplace_back("stray", ones({1})); });
    CHECK_WEAVE_ERROR(data::load_checkpoint(path, target), "load_checkpoint", "'stray'");
    // the other model and optimizer are untouched by all of the above
    CHECK(equal(other.fc1->weight, before));
    CHECK(other_opt.lr() == 0.5);
    // a truncated file
    rewrite([](auto&) {});
    std::filesystem::resize_file(path, std::filesystem::file_size(path) - 3);
    CHECK_WEAVE_ERROR(data::load_checkpoint(path, target), "safetensors", "truncated");
    CHECK(equal(other.fc1->weight, before));
    // and the intact file loads
    data::save_safetensors(path, file.tensors, file.metadata);
    data::load_checkpoint(path, target);
    CHECK(equal(other.fc1->weight, saved.fc1->weight));
    CHECK(other_opt.lr() == 0.01);
    std::filesystem::remove_all(dir);
  }
}
