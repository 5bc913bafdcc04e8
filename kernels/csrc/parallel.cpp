// The kernels' parallel loop (parallel.h) as the start-up log and the tests
// see it: how many threads it runs on, and who runs a thread's share while
// that thread is away, in a loop of its own or posted to a team.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "parallel.h"

namespace sf {
namespace {

// How many threads a parallel loop of `items` runs on, as every kernel's
// does: 1 where the build lacks OpenMP or torch has one thread. The start-up
// log states it beside the threads the engine was given. Counted by the
// threads that joined the loop, not by who ran an item: one thread may take
// every item of a loop this light before the others arrive.
int64_t threads_used(int64_t items) {
  std::vector<char> joined(static_cast<size_t>(at::get_num_threads()), 0);
  parallel_items(items, [](int64_t, bool) {}, [&] { joined[static_cast<size_t>(at::get_thread_num())] = 1; });
  return std::count(joined.begin(), joined.end(), 1);
}

// Which thread ran each of `items` items when the last thread, at its first
// item of its own share, is away for `away_ms` (as the OS takes a thread off
// its core for a neighbour): the others take the rest of its share. With
// `team`, the loop is posted to a team (with_team), as dot_layers' are.
at::Tensor items_run_by(int64_t items, int64_t away_ms, bool team) {
  at::Tensor by = at::full({items}, -1, at::kLong);
  int64_t* b = by.data_ptr<int64_t>();
  const int last = std::max(1, static_cast<int>(std::min<int64_t>(at::get_num_threads(), items))) - 1;
  bool away = false;  // written by the last thread only
  auto loop = [&] {
    parallel_items(items, [&](int64_t i, bool own) {
      const int thread = at::get_thread_num();
      if (own && thread == last && !away) {
        away = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(away_ms));
      }
      b[i] = thread;
    });
  };
  if (team)
    with_team(loop);
  else
    loop();
  return by;
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("threads_used(int items) -> int", &sf::threads_used);
  m.def("items_run_by(int items, int away_ms, bool team) -> Tensor", &sf::items_run_by);
}
