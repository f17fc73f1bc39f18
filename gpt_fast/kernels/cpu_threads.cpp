// The threads of our CPU kernels (cpu_gemv.cpp, cpu_attention.cpp, cpu_layers.cpp): gpt_fast_cpu::share_tasks runs
// a product's or an attention's tasks on the calling thread and on helper threads of its own.
//
// Why not OpenMP's (at::parallel_for): a parallel region ends when every thread of it has arrived, so the caller
// waits for each helper to wake up, even one that finds every task taken; beside a busy process a helper may wait
// milliseconds for a core, and a decode step of the default model runs some 120 products. Here the caller claims
// tasks like any helper, and once none is left it waits only for the tasks helpers have started: a helper that has
// not woken up yet takes none and costs nothing. After a job it took part in, a helper spins for SPIN, giving its core
// away at each check (sched_yield, so that a spinning helper never keeps another thread of this process or of another
// from a core), then sleeps until the next job.

#include <ATen/Parallel.h>
#include <c10/util/FunctionRef.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

using Task = c10::function_ref<void(int64_t)>;
using Clock = std::chrono::steady_clock;

constexpr int GENERATION_SHIFT = 32;  // state: the job's generation << 32 | its next task
constexpr uint64_t TASK_MASK = (uint64_t{1} << GENERATION_SHIFT) - 1;
constexpr auto SPIN = std::chrono::microseconds(200);        // a helper's wait for the next job before it sleeps
constexpr auto CALLER_SPIN = std::chrono::microseconds(20);  // the caller's wait for helpers before it sleeps
constexpr int CHECKS_PER_CLOCK = 16;                         // state checks between two readings of the clock

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

class Pool {
 public:
  void run(int64_t tasks, int64_t threads, Task task);

 private:
  void start_helpers(int64_t count);
  [[noreturn]] void helper(int64_t index);
  // claims and runs the tasks of job `generation` until none is left or another job has replaced it
  void take(uint64_t generation, const Task* task, int64_t tasks);
  bool replaced(uint64_t generation) const {
    return (state_.load(std::memory_order_seq_cst) >> GENERATION_SHIFT) != generation;
  }

  // The job: written by the caller while the last job's state says that none of its tasks is left, read by a helper
  // after it sees the new generation; a helper runs a task only after claiming it in state_ under the generation it
  // read the job for, which the caller keeps until every task is finished, so the job it read is the caller's.
  std::atomic<uint64_t> state_{0};
  std::atomic<const Task*> task_{nullptr};
  std::atomic<int64_t> tasks_{0};
  std::atomic<int64_t> helpers_{0};   // helpers that may take tasks of this job: the first ones
  std::atomic<int64_t> finished_{0};  // tasks of this job finished, by anyone
  std::atomic<int> sleeping_{0};      // helpers asleep or about to be
  std::atomic<bool> caller_sleeps_{false};
  std::exception_ptr error_;  // the first exception a task of this job threw (under mutex_)
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;  // a job is running: another caller (or a task) runs its own serially
  std::mutex mutex_;
  std::condition_variable wake_helpers_, wake_caller_;
  int64_t started_ = 0;  // helper threads started; only the caller holding busy_ reads or writes it
};

void Pool::run(int64_t tasks, int64_t threads, Task task) {
  threads = std::min(threads, tasks);
  if (threads <= 1 || busy_.test_and_set(std::memory_order_acquire)) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
    return;
  }
  start_helpers(threads - 1);
  task_.store(&task, std::memory_order_relaxed);
  tasks_.store(tasks, std::memory_order_relaxed);
  helpers_.store(threads - 1, std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  const uint64_t generation = ((state_.load(std::memory_order_relaxed) >> GENERATION_SHIFT) + 1) & TASK_MASK;
  state_.store(generation << GENERATION_SHIFT, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_helpers_.notify_all();
  }
  take(generation, &task, tasks);
  // every task is claimed: wait for those a helper is running, spinning briefly, then asleep so that the core is
  // free for the helper itself where another process had kept it waiting
  const auto until = Clock::now() + CALLER_SPIN;
  for (int check = 1; finished_.load(std::memory_order_acquire) < tasks; ++check) {
    pause();
    if (check % CHECKS_PER_CLOCK != 0 || Clock::now() < until) continue;
    std::unique_lock<std::mutex> lock(mutex_);
    caller_sleeps_.store(true, std::memory_order_seq_cst);
    wake_caller_.wait(lock, [&] { return finished_.load(std::memory_order_seq_cst) >= tasks; });
    caller_sleeps_.store(false, std::memory_order_relaxed);
  }
  state_.store((generation << GENERATION_SHIFT) | TASK_MASK, std::memory_order_release);  // no task is left
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(error, error_);
  }
  busy_.clear(std::memory_order_release);
  if (error) std::rethrow_exception(error);
}

void Pool::take(uint64_t generation, const Task* task, int64_t tasks) {
  uint64_t state = state_.load(std::memory_order_acquire);
  while ((state >> GENERATION_SHIFT) == generation && static_cast<int64_t>(state & TASK_MASK) < tasks) {
    if (!state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire))
      continue;
    try {
      (*task)(static_cast<int64_t>(state & TASK_MASK));
    } catch (...) {  // kept for the caller, which rethrows it once no task of the job is running
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    const bool last = finished_.fetch_add(1, std::memory_order_seq_cst) + 1 == tasks;
    if (last && caller_sleeps_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_caller_.notify_one();
    }
    state = state_.load(std::memory_order_acquire);
  }
}

void Pool::start_helpers(int64_t count) {
  for (; started_ < count; ++started_) std::thread(&Pool::helper, this, started_).detach();
}

void Pool::helper(int64_t index) {
  uint64_t seen = state_.load(std::memory_order_acquire) >> GENERATION_SHIFT;
  bool took_part = false;  // in the last job: only then is the next one likely soon enough to spin for
  for (;;) {
    const auto until = Clock::now() + (took_part ? SPIN : Clock::duration::zero());
    for (int check = 1; !replaced(seen); ++check) {
      std::this_thread::yield();
      if (check % CHECKS_PER_CLOCK != 0 || Clock::now() < until) continue;
      sleeping_.fetch_add(1, std::memory_order_seq_cst);
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_helpers_.wait(lock, [&] { return replaced(seen); });
      }
      sleeping_.fetch_sub(1, std::memory_order_relaxed);
    }
    seen = state_.load(std::memory_order_acquire) >> GENERATION_SHIFT;
    took_part = index < helpers_.load(std::memory_order_relaxed);
    if (took_part) take(seen, task_.load(std::memory_order_relaxed), tasks_.load(std::memory_order_relaxed));
  }
}

}  // namespace

namespace gpt_fast_cpu {

// task(t) for t in 0 .. tasks - 1, on the calling thread and helpers, at most `wanted` threads in all and no more
// than torch's thread count (at::get_num_threads: --threads, OMP_NUM_THREADS), each taking the next task not taken
// yet; returns when all are finished, then rethrows the first exception a task threw (as at::parallel_for does).
// Called from a task, or while another thread's job runs, it runs the tasks on the calling thread.
void share_tasks(int64_t tasks, int64_t wanted, c10::function_ref<void(int64_t)> task) {
  // never destroyed: its helpers sleep until the process ends; a forked child, which has none of them (and maybe a
  // mutex one held), starts a pool of its own
  static std::atomic<Pool*> pool = [] {
    pthread_atfork(nullptr, nullptr, [] { pool.store(new Pool(), std::memory_order_relaxed); });
    return new Pool();
  }();
  const int64_t threads = std::min(wanted, static_cast<int64_t>(at::get_num_threads()));
  pool.load(std::memory_order_relaxed)->run(tasks, threads, task);
}

}  // namespace gpt_fast_cpu
