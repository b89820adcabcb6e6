#include "weave/data/safetensors_json.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "weave/tensor/tensor_impl.h"

namespace weave::data::detail {

namespace {

using json = nlohmann::json;
using Entry = SafetensorsEntry;

// A safetensors header is an object of objects holding short arrays: no more nesting, no
// longer arrays, and at most this many entries, or the file is crafted; checked on the raw
// bytes before the JSON parser allocates anything.
constexpr int kMaxHeaderDepth = 3;
constexpr int64_t kMaxHeaderEntries = int64_t{1} << 20;

// Rejects a header whose nesting, array lengths or entry count no safetensors header has;
// returns how many members the top-level object has (for reserving the entries).
int64_t check_header_layout(const unsigned char* p, uint64_t length, const std::string& name) {
  int depth = 0;
  int64_t counts[kMaxHeaderDepth + 1] = {};
  bool is_array[kMaxHeaderDepth + 1] = {};
  bool in_string = false, escaped = false;
  for (uint64_t i = 0; i < length; ++i) {
    const unsigned char c = p[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      WEAVE_CHECK(depth < kMaxHeaderDepth, "safetensors",
                  "{}: the header nests deeper than {} levels at byte {}; a safetensors header "
                  "never does (corrupt or crafted file)",
                  name, kMaxHeaderDepth, i + 8);
      ++depth;
      counts[depth] = 0;
      is_array[depth] = c == '[';
    } else if (c == '}' || c == ']') {
      if (depth > 0) --depth;
    } else if (c == ',' && depth > 0) {
      const int64_t n = ++counts[depth];
      WEAVE_CHECK(!is_array[depth] || n < kMaxDims, "safetensors",
                  "{}: the header holds an array of more than {} elements at byte {} (corrupt "
                  "or crafted file)",
                  name, kMaxDims, i + 8);
      WEAVE_CHECK(n < kMaxHeaderEntries, "safetensors",
                  "{}: the header holds more than {} entries (corrupt or crafted file)", name,
                  kMaxHeaderEntries);
    }
  }
  return counts[1] + 1;
}

bool parse_dtype(const std::string& text, DType* out) {
  for (DType d : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool})
    if (text == format_dtype(d)) {
      *out = d;
      return true;
    }
  return false;
}

// What one entry's object held, as the parser reported it; judged once the object closes.
struct RawEntry {
  bool dtype_is_string = false;
  std::string dtype;
  bool shape_is_array = false, sizes_ok = true;
  int rank = 0;
  Shape shape;
  bool offsets_is_array = false, offsets_ok = true;
  int offset_count = 0;
  uint64_t offsets[2] = {0, 0};
};

Entry judge_entry(const std::string& key, const RawEntry& raw, const std::string& name) {
  auto bad = [&](const std::string& why) {
    WEAVE_FAIL("safetensors", "{}: tensor '{}' has {}", name, key, why);
  };
  Entry e{key, kFloat32, {}, 0, 0};
  if (!raw.dtype_is_string) bad("no dtype");
  if (!parse_dtype(raw.dtype, &e.dtype))
    bad(fmt::format("dtype '{}', which weave does not read (F32 F64 BF16 F16 I32 I64 U8 BOOL)",
                    raw.dtype));
  if (!raw.shape_is_array || raw.rank > kMaxDims)
    bad(fmt::format("no shape of at most {} dimensions", kMaxDims));
  if (!raw.sizes_ok) bad("a size that is not a non-negative integer");
  e.shape = raw.shape;
  if (!raw.offsets_is_array || raw.offset_count != 2 || !raw.offsets_ok)
    bad("no data_offsets [begin, end]");
  e.begin = raw.offsets[0];
  e.end = raw.offsets[1];
  if (e.begin > e.end) bad(fmt::format("data_offsets [{}, {}] that run backwards", e.begin, e.end));
  int64_t bytes = 0;
  try {
    bytes = checked_byte_count(e.shape, e.dtype, "safetensors");
  } catch (const Error&) {
    bad(fmt::format("shape {}, whose byte count overflows", e.shape));
  }
  if (e.end - e.begin != uint64_t(bytes))
    bad(fmt::format("{} bytes in data_offsets [{}, {}], but {} {} needs {}", e.end - e.begin,
                    e.begin, e.end, format_dtype(e.dtype), e.shape, bytes));
  return e;
}

// nlohmann's SAX interface: the header's entries and metadata built as the parser reads,
// instead of a JSON document of it. Levels: 1 the top object, 2 an entry or __metadata__,
// 3 an entry field's array (or an ignored field's value).
class HeaderEvents {
 public:
  HeaderEvents(const std::string& name, std::vector<Entry>& entries, Metadata& metadata)
      : name_(name), entries_(entries), metadata_(metadata) {}

  bool null() { return value(Kind::Other); }
  bool boolean(bool) { return value(Kind::Other); }
  bool number_integer(json::number_integer_t) { return value(Kind::Other); }  // negative
  bool number_unsigned(json::number_unsigned_t v) { return value(Kind::Unsigned, v); }
  bool number_float(json::number_float_t, const json::string_t&) { return value(Kind::Other); }
  bool string(json::string_t& s) { return value(Kind::String, 0, &s); }
  bool binary(json::binary_t&) { return value(Kind::Other); }
  bool start_object(std::size_t) { return open(/*array=*/false); }
  bool start_array(std::size_t) { return open(/*array=*/true); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    if (level_ == 1) top_key_ = std::move(k);
    if (level_ == 2 && in_metadata_) meta_key_ = std::move(k);
    if (level_ == 2 && !in_metadata_)
      field_ = k == "dtype"          ? Field::Dtype
               : k == "shape"        ? Field::Shape
               : k == "data_offsets" ? Field::Offsets
                                     : Field::Other;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;  // sax_parse returns false: the caller reports text that is not JSON
  }

 private:
  enum class Kind { Unsigned, String, Other };
  enum class Field { Dtype, Shape, Offsets, Other };

  [[noreturn]] void not_an_object() const {
    WEAVE_FAIL("safetensors",
               "{}: the header is not a JSON object; hint: is this a "
               "safetensors file?",
               name_);
  }
  // A top-level member whose value is not an object.
  [[noreturn]] void bad_member() const {
    WEAVE_CHECK(top_key_ != "__metadata__", "safetensors", "{}: __metadata__ is not an object",
                name_);
    WEAVE_FAIL("safetensors", "{}: tensor '{}' has a header entry that is not an object", name_,
               top_key_);
  }
  [[noreturn]] void bad_metadata() const {
    WEAVE_FAIL("safetensors", "{}: metadata '{}' is not a string", name_, meta_key_);
  }

  bool value(Kind kind, uint64_t number = 0, json::string_t* text = nullptr) {
    if (level_ == 0) not_an_object();
    if (level_ == 1) bad_member();
    if (level_ == 2 && in_metadata_) {
      if (kind != Kind::String) bad_metadata();
      metadata_[meta_key_] = std::move(*text);
    } else if (level_ == 2) {
      set_field_kind(kind == Kind::String, /*array=*/false);
      if (field_ == Field::Dtype && kind == Kind::String) raw_.dtype = std::move(*text);
    } else if (array_ == Field::Shape) {
      const bool size = kind == Kind::Unsigned && number <= uint64_t(INT64_MAX);
      raw_.sizes_ok = raw_.sizes_ok && size;
      if (++raw_.rank <= kMaxDims) raw_.shape.push_back(size ? int64_t(number) : 0);
    } else if (array_ == Field::Offsets) {
      raw_.offsets_ok = raw_.offsets_ok && kind == Kind::Unsigned;
      if (raw_.offset_count < 2) raw_.offsets[raw_.offset_count] = number;
      ++raw_.offset_count;
    }
    return true;
  }
  // A field's value began: what it is decides whether the field can be read.
  void set_field_kind(bool is_string, bool is_array) {
    if (field_ == Field::Dtype) raw_.dtype_is_string = is_string;
    if (field_ == Field::Shape) {
      raw_.shape_is_array = is_array;
      raw_.sizes_ok = true;
      raw_.rank = 0;
      raw_.shape = Shape();
    }
    if (field_ == Field::Offsets) {
      raw_.offsets_is_array = is_array;
      raw_.offsets_ok = true;
      raw_.offset_count = 0;
    }
  }
  bool open(bool array) {
    if (level_ == 0 && array) not_an_object();
    if (level_ == 1 && array) bad_member();
    if (level_ == 1) {
      in_metadata_ = top_key_ == "__metadata__";
      raw_ = RawEntry();
    }
    if (level_ == 2 && in_metadata_) bad_metadata();
    if (level_ == 2) {
      set_field_kind(/*is_string=*/false, array);
      array_ = array ? field_ : Field::Other;
    }
    WEAVE_CHECK(level_ < 3, "safetensors", "{}: the header nests too deeply", name_);
    ++level_;
    return true;
  }
  bool close() {
    if (level_ == 2 && !in_metadata_) entries_.push_back(judge_entry(top_key_, raw_, name_));
    if (level_ == 3) array_ = Field::Other;
    --level_;
    return true;
  }

  const std::string& name_;
  std::vector<Entry>& entries_;
  Metadata& metadata_;
  int level_ = 0;
  std::string top_key_, meta_key_;
  bool in_metadata_ = false;
  Field field_ = Field::Other, array_ = Field::Other;
  RawEntry raw_;
};

}  // namespace

const char* format_dtype(DType dtype) {
  switch (dtype) {
    case kFloat32:
      return "F32";
    case kFloat64:
      return "F64";
    case kBFloat16:
      return "BF16";
    case kFloat16:
      return "F16";
    case kInt32:
      return "I32";
    case kInt64:
      return "I64";
    case kUInt8:
      return "U8";
    case kBool:
      return "BOOL";
  }
  return "?";
}

void read_header_json(const unsigned char* text, uint64_t length, const std::string& name,
                      std::vector<SafetensorsEntry>& entries, Metadata& metadata) {
  entries.clear();
  entries.reserve(size_t(check_header_layout(text, length, name)));
  HeaderEvents events(name, entries, metadata);
  WEAVE_CHECK(json::sax_parse(text, text + length, &events), "safetensors",
              "{}: the header is not a JSON object; hint: is this a safetensors file?", name);
  // A name given twice would leave one of its tensors unreachable by name.
  std::vector<const std::string*> names;
  names.reserve(entries.size());
  for (const Entry& e : entries) names.push_back(&e.name);
  std::sort(names.begin(), names.end(), [](auto* a, auto* b) { return *a < *b; });
  const auto twice =
      std::adjacent_find(names.begin(), names.end(), [](auto* a, auto* b) { return *a == *b; });
  WEAVE_CHECK(twice == names.end(), "safetensors", "{}: tensor name '{}' appears twice", name,
              twice == names.end() ? std::string() : **twice);
}

}  // namespace weave::data::detail
