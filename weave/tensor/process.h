#pragma once
// This process's place in a distributed job (rank 0 of 1 outside one). dist::init sets it and
// finalize resets it, so that the floors below the distributed module can tell whose state they
// hold (a checkpoint records the rank that saved it).
#include <atomic>

namespace weave {

struct ProcessPlace {
  int rank = 0;
  int world_size = 1;
};

namespace detail {
inline std::atomic<int> process_rank{0};
inline std::atomic<int> process_world_size{1};
}  // namespace detail

inline ProcessPlace process_place() {
  return {detail::process_rank.load(), detail::process_world_size.load()};
}
inline void set_process_place(ProcessPlace place) {
  detail::process_rank = place.rank;
  detail::process_world_size = place.world_size;
}

}  // namespace weave
