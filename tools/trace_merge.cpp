// Merges per-rank traces (WEAVE_TRACE) into one Chrome trace / Perfetto timeline and reports
// what they hold:
//   weave_trace_merge trace.rank0.json trace.rank1.json > trace.json
// stderr: one line per file, "FILE: N events (op A, backward B, optimizer C, collective D,
// E bytes)". Exits 1 if a file is not a valid trace; with --require-collectives, also if a
// file has no collective event (the check CTest runs).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  bool require_collectives = false;
  std::vector<std::string> paths;
  CLI::App app(
      "Merges the per-rank traces that WEAVE_TRACE=trace.json writes (trace.rank0.json,\n"
      "trace.rank1.json, ...) into one Chrome trace / Perfetto timeline on stdout, and prints\n"
      "one summary line per file on stderr. Exits 1 if a file is not a valid trace, or, with\n"
      "--require-collectives, holds no collective event.",
      "weave_trace_merge");
  app.add_flag("--require-collectives", require_collectives,
               "fail on a file without collective events");
  app.add_option("traces", paths, "the per-rank trace files")->required()->check(CLI::ExistingFile);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  nlohmann::json merged = {{"displayTimeUnit", "ms"}, {"traceEvents", nlohmann::json::array()}};
  int files = 0;
  for (const std::string& path : paths) {
    std::ifstream in(path);
    nlohmann::json trace;
    try {
      trace = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: not valid JSON: %s\n", path.c_str(), e.what());
      return 1;
    }
    if (!trace.contains("traceEvents") || !trace["traceEvents"].is_array()) {
      std::fprintf(stderr, "%s: no traceEvents array\n", path.c_str());
      return 1;
    }
    std::map<std::string, int> count;
    long long bytes = 0;
    for (const auto& event : trace["traceEvents"]) {
      if (!event.contains("ph") || !event.contains("pid")) {
        std::fprintf(stderr, "%s: an event without ph or pid: %s\n", path.c_str(),
                     event.dump().c_str());
        return 1;
      }
      if (event["ph"] == "X") {
        const std::string category = event.value("cat", "");
        ++count[category];
        if (category == "collective" && event.contains("args"))
          bytes += event["args"].value("bytes", 0LL);
        if (!event.contains("ts") || !event.contains("dur") || event["dur"].get<double>() < 0) {
          std::fprintf(stderr, "%s: a complete event without ts/dur\n", path.c_str());
          return 1;
        }
      }
      merged["traceEvents"].push_back(event);
    }
    std::fprintf(stderr,
                 "%s: %zu events (op %d, backward %d, optimizer %d, collective %d, %lld bytes)\n",
                 path.c_str(), trace["traceEvents"].size(), count["op"], count["backward"],
                 count["optimizer"], count["collective"], bytes);
    if (require_collectives && count["collective"] == 0) {
      std::fprintf(stderr, "%s: no collective events\n", path.c_str());
      return 1;
    }
    ++files;
  }
  if (files == 0) {
    std::fprintf(stderr, "usage: weave_trace_merge [--require-collectives] TRACE.json...\n");
    return 2;
  }
  std::cout << merged.dump() << "\n";
  return 0;
}
