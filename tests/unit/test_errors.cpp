// Bad input raises weave::Error whose message starts with "[op]" and says what was wrong.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "helpers.h"
#include "weave/distributed/flight_recorder.h"

using namespace weave;

TEST_SUITE("errors") {
  TEST_CASE("shape errors") {
    CHECK_WEAVE_ERROR(ones({2, 3}) * ones({3, 2}), "mul", "cannot be broadcast");
    CHECK_WEAVE_ERROR(matmul(ones({2, 3}), ones({2, 3})), "matmul", "inner dimensions differ");
    CHECK_WEAVE_ERROR(matmul(ones({}), ones({3})), "matmul", "at least 1 dimension");
    CHECK_WEAVE_ERROR(ones({6}).reshape({4, -1}), "reshape", "invalid for input of size 6");
    CHECK_WEAVE_ERROR(ones({6}).reshape({-1, -1}), "reshape", "only one dimension can be -1");
    CHECK_WEAVE_ERROR(ones({2, 3}).sum({2}), "sum", "out of range");
    CHECK_WEAVE_ERROR(ones({2, 3}).sum({1, -1}), "sum", "more than once");
    CHECK_WEAVE_ERROR(ones({2, 3}).permute({0, 0}), "permute", "repeats");
    CHECK_WEAVE_ERROR(ones({2, 3}).narrow(1, 2, 2), "narrow", "outside dimension");
    CHECK_WEAVE_ERROR(ones({2, 3}).expand({4, 3, 4}), "expand", "cannot expand");
    CHECK_WEAVE_ERROR(cat({ones({2, 3}), ones({2, 4})}, 0), "cat", "outside dimension 0");
    CHECK_WEAVE_ERROR(cat({}, 0), "cat", "at least one");
    CHECK_WEAVE_ERROR(stack({ones({2}), ones({3})}), "stack", "expected [2]");
    CHECK_WEAVE_ERROR(split(ones({5}), std::vector<int64_t>{2, 2}), "split", "add up to 4");
    CHECK_WEAVE_ERROR(ones({2, 3}).select(0, 2), "select", "out of range");
    CHECK_WEAVE_ERROR(ones(Shape::filled(9, 1)), "shape", "at most 8 dimensions");
    CHECK_WEAVE_ERROR(empty({-1}), "empty", "non-negative");
  }

  TEST_CASE("sizes that overflow are errors, not wrapped counts") {
    const int64_t big = int64_t{1} << 62, huge = int64_t{1} << 32;
    CHECK_THROWS_WITH_AS(empty({big}), doctest::Contains("overflows int64"), Error);
    CHECK_THROWS_WITH_AS(zeros({huge, huge}), doctest::Contains("overflows int64"), Error);
    CHECK_THROWS_WITH_AS(zeros({3037000500, 3037000500}), doctest::Contains("int64"), Error);
    CHECK_THROWS_WITH_AS(ones({1, 1}).expand({huge, huge}),
                         doctest::Contains("more elements than int64"), Error);
    CHECK_THROWS_WITH_AS(ones({1}).expand({-5}), doctest::Contains("non-negative"), Error);
    CHECK_THROWS_WITH_AS(Dims::filled(-1, 0),
                         doctest::Contains("at most 8 dimensions (and not fewer than 0), found -1"),
                         Error);
    CHECK_THROWS_WITH_AS(scalar_tensor(3).size(0), doctest::Contains("0-d tensor"), Error);
    CHECK(ones({3, 4}).expand({2, 3, 4}).shape() == Shape{2, 3, 4});
    float cell = 0;
    CHECK_WEAVE_ERROR(from_blob(&cell, {big, 4}, kFloat32), "from_blob", "overflows int64");
    CHECK_WEAVE_ERROR(from_blob(&cell, {-2}, kFloat32), "from_blob", "non-negative");
    CHECK_WEAVE_ERROR(from_blob(nullptr, {2}, kFloat32), "from_blob", "null pointer");
    CHECK_WEAVE_ERROR(ones({4}).narrow(0, 1, INT64_MAX), "narrow", "outside dimension");
    CHECK_WEAVE_ERROR(ones({4}).narrow(0, 5, 0), "narrow", "outside dimension");
    CHECK(ones({4}).narrow(0, 4, 0).shape() == Shape{0});
    // a step as large as int64 allows: one element, not a wrapped count
    Tensor every = arange(5).slice(0, 1, 5, INT64_MAX);
    CHECK(every.shape() == Shape{1});
    CHECK(every.item<int64_t>() == 1);
    CHECK(arange(10).slice(0, 0, 10, 4).to_vector<int64_t>() == std::vector<int64_t>{0, 4, 8});
    CHECK(arange(10).slice(0, 3, 3, 2).shape() == Shape{0});
    CHECK_WEAVE_ERROR(arange(0, 1e30), "arange", "more than can be counted");
    CHECK(arange(0, 3).numel() == 3);
  }

  TEST_CASE("a group from before finalize() is an error after a new init()") {
    if (dist::initialized()) return;
    dist::init();
    const dist::Group old = dist::world();
    dist::finalize();
    dist::init();
    Tensor t = ones({2});
    CHECK_WEAVE_ERROR(dist::all_reduce(t, dist::ReduceOp::Sum, old), "all_reduce",
                      "session that finalize() ended");
    dist::all_reduce(t);  // the new world works
    CHECK(t.to_vector<float>() == std::vector<float>{1, 1});
    dist::finalize();
  }

  TEST_CASE("undefined tensors raise instead of crashing") {
    CHECK_WEAVE_ERROR(Tensor().grad(), "grad", "undefined tensor");
    CHECK_WEAVE_ERROR(Tensor().is_leaf(), "is_leaf", "undefined tensor");
    CHECK_WEAVE_ERROR(Tensor().set_grad(ones({1})), "set_grad", "undefined tensor");
    CHECK_FALSE(Tensor().requires_grad());
    CHECK(Tensor().grad_fn() == nullptr);
  }

  TEST_CASE("no silent truncation or surprising results (PyTorch's behaviour or an error)") {
    Tensor counts = from_vector<int64_t>({1, 2});
    CHECK_WEAVE_ERROR(counts.add_(0.5), "add_", "cannot be written into the int64 tensor");
    CHECK_WEAVE_ERROR(counts.mul_(1.5), "mul_", "cannot be written into the int64 tensor");
    CHECK_WEAVE_ERROR(counts.add_(ones({2})), "add_", "float32");
    CHECK(counts.to_vector<int64_t>() == std::vector<int64_t>{1, 2});  // untouched
    counts.add_(2.0);                                                  // integral: fine
    CHECK(counts.to_vector<int64_t>() == std::vector<int64_t>{3, 4});
    CHECK_WEAVE_ERROR(pow(from_vector<int64_t>({2, 3}), -1), "pow", "negative integer powers");
    CHECK_WEAVE_ERROR(pow(from_vector<int32_t>({2}), from_vector<int32_t>({-2})), "pow",
                      "negative integer powers");
    CHECK(pow(from_vector<int64_t>({2, 3}), 2).to_vector<int64_t>() == std::vector<int64_t>{4, 9});
    CHECK(pow(from_vector<int64_t>({2}), -1.0 + 0.5).dtype() == kFloat32);  // a fraction: float
    CHECK_WEAVE_ERROR(layer_norm(ones({2, 3}), {3}, {}, {}, -1e-5), "layer_norm", "eps");
    Tensor w = ones({2}).requires_grad_();
    CHECK_WEAVE_ERROR(optim::SGD({w, w}, {.lr = 0.1}), "optimizer", "parameters 0 and 1");
    // softmax over an empty dimension: an empty result, as in PyTorch
    CHECK(softmax(zeros({3, 0}), 1).shape() == Shape{3, 0});
    CHECK(log_softmax(zeros({0, 4}), 0).shape() == Shape{0, 4});
    CHECK(softmax(zeros({0, 4}), 1).shape() == Shape{0, 4});
  }

  TEST_CASE("dtype and value errors") {
    CHECK_WEAVE_ERROR(where(ones({2}), ones({2}), ones({2})), "where", "bool condition");
    CHECK_WEAVE_ERROR(index_select(ones({3}), 0, ones({1})), "index_select", "int32 or int64");
    CHECK_WEAVE_ERROR(index_select(ones({3}), 0, from_vector<int64_t>({3})), "index_select",
                      "out of range");
    CHECK_WEAVE_ERROR(cross_entropy(ones({2, 3}), from_vector<int64_t>({0, 3})), "cross_entropy",
                      "[0, 3)");
    CHECK_WEAVE_ERROR(cross_entropy(ones({2, 3}), ones({2})), "cross_entropy",
                      "integer class targets");
    CHECK_WEAVE_ERROR(cross_entropy(ones({2, 3}), from_vector<int64_t>({0})), "cross_entropy",
                      "expected logits");
    CHECK_WEAVE_ERROR(mse_loss(ones({2}), ones({3})), "mse_loss", "same shape");
    CHECK_WEAVE_ERROR(layer_norm(ones({2, 3}), {2}), "layer_norm", "does not end with");
    CHECK_WEAVE_ERROR(linear(ones({2, 3}), ones({4, 5})), "linear", "input features differ");
    CHECK_WEAVE_ERROR(ones({2}, {.dtype = kBool}) + ones({2}, {.dtype = kBool}), "add", "bool");
    CHECK_WEAVE_ERROR(ones({3}).item(), "item", "one-element");
    CHECK_WEAVE_ERROR(ones({2}).data<double>(), "data", "float32");
    CHECK_WEAVE_ERROR(dropout(ones({2}), 1.5), "dropout", "[0, 1]");
    CHECK_WEAVE_ERROR(rand({2}, {.dtype = kInt32}), "rand", "floating");
    CHECK_WEAVE_ERROR(randint(3, 3, {2}), "randint", "low < high");
    CHECK_WEAVE_ERROR(argmax(zeros({0})), "argmax", "empty");
    CHECK_WEAVE_ERROR(max(zeros({0})), "max", "empty");
    CHECK_WEAVE_ERROR(var(ones({1})), "var", "degrees of freedom");
    CHECK_WEAVE_ERROR(ones({2}) + Tensor(), "add", "undefined");
  }

  TEST_CASE("device errors without a GPU") {
    if (cuda::is_available()) return;
    CHECK_WEAVE_ERROR(ones({2}, {.device = Device::cuda(0)}), "cuda", "without CUDA");
    CHECK_WEAVE_ERROR(ones({2}).to(Device::cuda(0)), "cuda", "without CUDA");
  }

  TEST_CASE("module and optimizer errors") {
    nn::Linear layer(2, 2);
    CHECK_WEAVE_ERROR(nn::Linear(0, 2), "Linear", "positive");
    CHECK_WEAVE_ERROR(optim::SGD({ones({2})}, {.lr = 0.1}), "optimizer", "leaf that requires grad");
    CHECK_WEAVE_ERROR(optim::SGD(layer.parameters(), {.lr = -1}), "optimizer", "non-negative");
    CHECK_WEAVE_ERROR(optim::SGD(layer.parameters(), {.lr = 0.1, .nesterov = true}), "SGD",
                      "Nesterov");
    CHECK_WEAVE_ERROR(optim::Adam(layer.parameters(), {.beta1 = 1.0}), "Adam", "betas");
    CHECK_WEAVE_ERROR(layer(ones({3})), "linear", "input features differ");
    CHECK_WEAVE_ERROR(nn::init::gain("swish"), "init", "unknown nonlinearity");
    auto data = std::make_shared<data::TensorDataset>(ones({3, 1}), ones({3}));
    CHECK_WEAVE_ERROR(data::DataLoader(data, {.batch_size = 0}), "DataLoader", "positive");
    CHECK_WEAVE_ERROR(data::TensorDataset(ones({3}), ones({2})), "TensorDataset",
                      "same first dimension");
  }

  TEST_CASE("the flight recorder writes a fresh file: a link planted at its path is replaced") {
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / ("weave_flight_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    const fs::path victim = dir / "victim", path = dir / "flight.rank0.json";
    std::ofstream(victim) << "precious";
    fs::create_symlink(victim, path);
    ::setenv("WEAVE_FLIGHT_RECORDER", "4", 1);
    ::setenv("WEAVE_FLIGHT_RECORDER_FILE", (dir / "flight.json").c_str(), 1);
    dist::detail::configure_flight_recorder(0);
    dist::detail::dump_flight_recorder("a test");
    CHECK(data::read_file(victim.string()) == "precious");
    CHECK(!fs::is_symlink(path));
    CHECK(data::read_file(path.string()).find("a test") != std::string::npos);
    ::setenv("WEAVE_FLIGHT_RECORDER", "0", 1);
    dist::detail::configure_flight_recorder(0);
    fs::remove_all(dir);
  }
}
