#pragma once
// The safetensors header's JSON, read and written: the dtype names, and a reader that builds
// the entries straight from the parser's events. (Internal to weave/data.)
#include <string>
#include <vector>

#include "weave/data/safetensors.h"

namespace weave::data::detail {

/// The format's name of a dtype ("F32", "BF16", ...).
const char* format_dtype(DType dtype);

/// Checks the header text (`length` bytes at `text`; errors name bytes from the file's start)
/// and returns its tensor entries in header order and its "__metadata__". Every malformed or
/// crafted header raises weave::Error naming `name`: nesting, arrays or an entry count no
/// safetensors header has (checked on the raw bytes before anything is allocated), text that
/// is not a JSON object, an entry without a readable dtype, shape or data_offsets, a name given
/// twice. The memory used is a fixed-size entry per tensor plus the metadata, about twice the
/// header's bytes; a JSON document of the header would take about 16 times.
void read_header_json(const unsigned char* text, uint64_t length, const std::string& name,
                      std::vector<SafetensorsEntry>& entries, Metadata& metadata);

}  // namespace weave::data::detail
