#pragma once
// Command lines for training programs, through CLI11 (header-only; Debian: libcli11-dev): a
// generated --help, an error that names a mistyped or malformed flag, and value ranges checked
// before anything runs. Optional: weave.h does not include it, so only a program that does
// needs CLI11.
//
//   #include <weave/util/cli.h>
//   CLI::App app("Trains a model.", "train");
//   int64_t steps = 1000;
//   double lr = 1e-3;
//   app.add_option("--steps", steps)->check(weave::cli::positive());
//   app.add_option("--lr", lr, "peak learning rate")->check(weave::cli::positive());
//   weave::cli::parse_or_exit(app, argc, argv);   // --help: exit 0; a bad flag: exit 2
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdlib>
#include <string>

namespace weave::cli {

/// A finite number above `floor` (or at least it, with `inclusive`), with an error that says so.
inline CLI::Validator number_from(double floor, bool inclusive, const char* name) {
  return CLI::Validator(
      [floor, inclusive](std::string& text) -> std::string {
        size_t used = 0;
        double value = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
        }
        if (used != text.size() || text.empty()) return "expected a number, found '" + text + "'";
        if (!std::isfinite(value)) return "expected a finite number, found " + text;
        const bool ok = inclusive ? value >= floor : value > floor;
        return ok ? ""
                  : std::string(inclusive ? "must be at least " : "must be above ") +
                        CLI::detail::to_string(floor) + ", found " + text;
      },
      name);
}
inline CLI::Validator positive() {
  return number_from(0, false, "POSITIVE");
}
inline CLI::Validator non_negative() {
  return number_from(0, true, "NON-NEGATIVE");
}

/// Parses argv into the options `app` declares. --help prints the help and exits 0; a bad
/// command line prints CLI11's error and the usage line and exits 2, the usage-error status
/// that weave-run does not relaunch.
inline void parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    std::exit(code == 0 ? 0 : 2);
  }
}

}  // namespace weave::cli
