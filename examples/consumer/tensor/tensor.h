#pragma once
// The consumer's own tensor/tensor.h: weave's headers must never be found in its place.
namespace consumer {
inline constexpr const char* kOwnTensorHeader = "consumer's tensor/tensor.h";
}
