// The kernels' parallel loops.
//
// Each thread starts on a share of the items of its own, in order, as
// at::parallel_for's static split does, and when its share is done takes the
// next items of the others' shares. And a stack of loops (dot_layers: every
// layer of a step) runs in one team (with_team): the first thread goes through
// the loops, posting each to the others, and a loop is done when its items
// are, whoever of the team turned up for it.
//
// Why: on the machines stallfree runs on, the gateway, the load client and
// the OS share the cores with the engine's threads. A thread taken off its
// core for a while held up every loop it belonged to: with a static split its
// share waited for it, and each OpenMP region's closing barrier waited for it
// to come back even with nothing left to do: 270 regions a step (9 a layer).
// A neighbour busy 0.4 ms every 5 ms lengthened a 2-thread decode step at 32
// streams by 16-20 % (scratch, Zen 4), twice its own CPU time. Now a loop
// waits at most for the one item an absent thread holds, and the team's one
// barrier is at its end. Measured in one engine, 8-step blocks alternating
// (scratch, Zen 4, 2 threads): beside that neighbour the team's steps took
// 0.94-0.96x the static split's (taking alone 0.97-0.98x); alone 0.97-0.99x.
// Most of the neighbour's cost remains: while the first thread is away, no
// loop is posted. An item's result does not depend on which thread ran it, so
// the output is the static split's, bit for bit.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace sf {

// A spinning thread's pause: it frees the core's pipeline for its sibling.
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The team with_team holds together: the loop posted now, and who is in it.
struct Team {
  std::atomic<bool> open{false};  // a loop is posted and has items to take
  std::atomic<int> inside{0};     // threads running the posted loop
  std::atomic<uint64_t> posted{0};
  std::atomic<bool> over{false};
  void (*run)(const void* loop, int thread) = nullptr;
  const void* loop = nullptr;

  // The first thread: post `take`, take with the others, and return once every
  // thread that came in has left (their items done); no one else is waited for.
  template <typename Take>
  void lead(const Take& take) {
    loop = &take;
    run = [](const void* l, int thread) { (*static_cast<const Take*>(l))(thread); };
    open.store(true);
    posted.fetch_add(1);
    take(0);
    open.store(false);
    while (inside.load() != 0) relax();
  }

  // Every other thread: run each loop posted while it is here, until the end.
  void serve(int thread) {
    uint64_t seen = posted.load();
    while (!over.load(std::memory_order_relaxed)) {
      if (posted.load() == seen) {
        relax();
        continue;
      }
      seen = posted.load();
      inside.fetch_add(1);
      if (open.load()) run(loop, thread);  // open after coming in: lead waits for it to leave
      inside.fetch_sub(1);
    }
  }
};

inline thread_local Team* t_team = nullptr;  // the team this thread leads, in with_team

// Runs f(i, own) for every item i in [bounds[0], bounds.back()): share s is
// [bounds[s], bounds[s + 1]), started by thread s; `own` is true when the
// calling thread is the share's own, which then runs it in order (an own
// item's successor is likely the thread's next: worth prefetching). Each
// thread then calls finish() once (per-thread state: AMX tiles). f and finish
// must not throw (they run inside an OpenMP region).
template <typename F, typename Finish>
void parallel_shares(const std::vector<int64_t>& bounds, const F& f, const Finish& finish) {
  const int shares = static_cast<int>(bounds.size()) - 1;
  if (shares <= 0) return;
  struct alignas(64) Next {
    std::atomic<int64_t> item;
  };
  std::unique_ptr<Next[]> next(new Next[shares]);
  for (int s = 0; s < shares; ++s) next[s].item.store(bounds[s], std::memory_order_relaxed);
  auto take = [&](int thread) {
    at::internal::ThreadIdGuard guard(thread);
    for (int k = 0; k < shares; ++k) {
      const int s = (thread + k) % shares;
      for (int64_t i; (i = next[s].item.fetch_add(1, std::memory_order_relaxed)) < bounds[s + 1];) f(i, s == thread);
    }
    finish();
  };
  if (shares > 1 && t_team != nullptr) {
    t_team->lead(take);
    return;
  }
#ifdef _OPENMP
  if (shares > 1 && !at::in_parallel_region()) {
#pragma omp parallel
    take(omp_get_thread_num());
    return;
  }
#endif
  take(0);
}

template <typename F>
void parallel_shares(const std::vector<int64_t>& bounds, const F& f) {
  parallel_shares(bounds, f, [] {});
}

// n items in equal shares, one a thread (at most one a thread per item).
template <typename F, typename Finish>
void parallel_items(int64_t n, const F& f, const Finish& finish) {
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> bounds(static_cast<size_t>(shares) + 1);
  for (int64_t s = 0; s <= shares; ++s) bounds[s] = s * n / shares;
  parallel_shares(bounds, f, finish);
}

template <typename F>
void parallel_items(int64_t n, const F& f) {
  parallel_items(n, f, [] {});
}

// Runs body on this thread with torch's threads as one team: the parallel
// loops it calls are posted to the team instead of each opening an OpenMP
// region. Anything else in body runs on this thread alone.
template <typename Body>
void with_team(const Body& body) {
#ifdef _OPENMP
  if (at::get_num_threads() > 1 && !at::in_parallel_region() && t_team == nullptr) {
    Team team;
    std::exception_ptr error;
#pragma omp parallel
    {
      if (omp_get_thread_num() == 0) {
        t_team = &team;
        try {
          body();
        } catch (...) {
          error = std::current_exception();
        }
        t_team = nullptr;
        team.over.store(true);
      } else {
        team.serve(omp_get_thread_num());
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  body();
}

}  // namespace sf
