#pragma once
// The consumer's own data/dataloader.h, likewise.
namespace consumer {
inline constexpr int kOwnBatchSize = 16;
}
