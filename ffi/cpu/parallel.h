// Running independent chunks of work across the XLA FFI thread pool.
//
// parallel_chunks(pool, n, fn) calls fn(i) exactly once for every i in [0, n) and returns when all
// n calls have returned. The calling thread works too: it and up to (workers - 1) pool tasks take
// chunk indices from one atomic counter until none are left, so the handler never waits on a task
// merely to *start* (a busy or single-threaded pool cannot deadlock it). The caller waits only for
// chunks that some thread has already taken, and therefore is running.
//
// Lifetime: the shared state is held by std::shared_ptr, one reference per scheduled task. `fn`
// lives on the caller's stack and is reached only through a chunk index taken from the counter;
// since the caller does not return before every taken chunk has finished, `fn` outlives every
// call. A task that starts after the last chunk was taken finds the counter exhausted and returns
// without touching `fn` or anything else of the caller's.
//
// Without a pool (nullptr), with a pool of fewer than two threads, or with a single chunk,
// everything runs inline on the calling thread, in chunk order.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace te_jax::cpu {

// Threads that can run chunks concurrently: the pool's size (the caller is assumed to be one of
// them, or to stand in for a busy one), at least 1.
inline int64_t num_workers(::xla::ffi::ThreadPool* pool) {
  if (pool == nullptr) return 1;
  return std::max<int64_t>(1, pool->num_threads());
}

namespace detail {

struct ChunkQueue {
  std::atomic<int64_t> next{0};
  int64_t total = 0;
  void (*invoke)(const void* fn, int64_t chunk) = nullptr;
  const void* fn = nullptr;  // the caller's callable; see the lifetime note above

  std::mutex mu;
  std::condition_variable all_done;
  int64_t finished = 0;  // guarded by mu
};

// Takes chunks until none are left; then reports how many this thread ran.
inline void drain(ChunkQueue& q) {
  int64_t ran = 0;
  for (;;) {
    const int64_t c = q.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= q.total) break;
    q.invoke(q.fn, c);
    ++ran;
  }
  if (ran == 0) return;  // started late (or found nothing): touch nothing of the caller's
  std::lock_guard<std::mutex> lock(q.mu);
  q.finished += ran;
  if (q.finished == q.total) q.all_done.notify_all();
}

}  // namespace detail

template <typename Fn>
void parallel_chunks(::xla::ffi::ThreadPool* pool, int64_t n, const Fn& fn) {
  if (n <= 0) return;
  const int64_t workers = num_workers(pool);
  if (n == 1 || workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto q = std::make_shared<detail::ChunkQueue>();
  q->total = n;
  q->fn = &fn;
  q->invoke = [](const void* f, int64_t chunk) { (*static_cast<const Fn*>(f))(chunk); };
  const int64_t tasks = std::min(workers - 1, n - 1);
  for (int64_t t = 0; t < tasks; ++t) {
    pool->Schedule([q] { detail::drain(*q); });
  }
  detail::drain(*q);
  std::unique_lock<std::mutex> lock(q->mu);
  q->all_done.wait(lock, [&] { return q->finished == q->total; });
}

}  // namespace te_jax::cpu
