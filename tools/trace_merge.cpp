// Merges per-rank traces (WEAVE_TRACE) into one Chrome trace / Perfetto timeline and reports
// what they hold:
//   weave_trace_merge trace.rank0.json trace.rank1.json > trace.json
// stderr: one line per file, "FILE: N events (op A, backward B, optimizer C, collective D,
// E bytes)". Exits 1 if a file is not a valid trace; with --require-collectives, also if a
// file has no collective event (the check CTest runs).
// Flight recorder files (WEAVE_FLIGHT_RECORDER) merge the same way; for them it also prints, per
// group, the first call number at which the ranks' records differ: "first divergence: group
// [0, 1, 2, 3], call #12: ranks [0, 1, 3] issued all_reduce(float32 [4], sum) #12; rank 2 did
// not (its last: all_reduce(float32 [4], sum) #11)".
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace {

struct FlightCall {
  int64_t sequence;
  std::string call;
};
// Per group (its ranks, as text), per rank: the numbered calls its flight recorder kept.
using Flights = std::map<std::string, std::map<int, std::vector<FlightCall>>>;

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = "[";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + "]";
}

void collect_flight(const nlohmann::json& trace, Flights& flights) {
  if (!trace.contains("weaveFlight")) return;
  const nlohmann::json& flight = trace["weaveFlight"];
  const int rank = flight.value("rank", -1);
  for (const auto& call : flight["calls"]) {
    const std::string op = call.value("op", "");
    if (op == "send" || op == "recv" || op == "realign") continue;  // not numbered per group
    const std::string group = ranks_text(call["ranks"].get<std::vector<int>>());
    flights[group][rank].push_back({call["sequence"].get<int64_t>(), call.value("call", "?")});
  }
}

// The first call number, within what every rank still holds, at which the ranks differ.
void report_divergence(const std::string& group,
                       const std::map<int, std::vector<FlightCall>>& by_rank) {
  int64_t first = 0, last = -1;
  for (const auto& [rank, calls] : by_rank) {
    first = std::max(first, calls.front().sequence);
    last = std::max(last, calls.back().sequence);
  }
  for (int64_t s = first; s <= last; ++s) {
    std::map<std::string, std::vector<int>> issued;
    std::vector<std::string> absent;
    for (const auto& [rank, calls] : by_rank) {
      auto found = std::find_if(calls.begin(), calls.end(),
                                [s](const FlightCall& c) { return c.sequence == s; });
      if (found != calls.end()) {
        issued[found->call].push_back(rank);
        continue;
      }
      std::string before = "none recorded";
      for (const FlightCall& c : calls)
        if (c.sequence < s) before = c.call;
      absent.push_back("rank " + std::to_string(rank) + " did not (its last: " + before + ")");
    }
    if (issued.size() == 1 && absent.empty()) continue;
    std::string text = "first divergence: group " + group + ", call #" + std::to_string(s) + ": ";
    std::vector<std::string> parts;
    for (const auto& [call, ranks] : issued)
      parts.push_back("ranks " + ranks_text(ranks) + " issued " + call);
    parts.insert(parts.end(), absent.begin(), absent.end());
    for (size_t i = 0; i < parts.size(); ++i) text += (i ? "; " : "") + parts[i];
    std::fprintf(stderr, "%s\n", text.c_str());
    return;
  }
  std::fprintf(stderr, "group %s: the %zu ranks' recorded calls agree\n", group.c_str(),
               by_rank.size());
}

}  // namespace

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
  Flights flights;
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
    collect_flight(trace, flights);
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
  for (const auto& [group, by_rank] : flights) report_divergence(group, by_rank);
  std::cout << merged.dump() << "\n";
  return 0;
}
