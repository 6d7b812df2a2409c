// The barrier of ctxpar's shared-memory collectives (ctxpar/parallel/shm_channel.py).
//
// Ranks on one host exchange a collective's data through shared pages and
// then meet here: each rank publishes that it has arrived at collective
// number `target` in its own counter (its own cache line) and wakes whoever
// sleeps on it, then waits until every rank's counter has reached it. A rank
// that waits spins briefly (the peer is usually microseconds away), then
// sleeps on the counter (a futex on the shared page): a rank that waits out
// a whole step on another (rank 0 computing a step alone with the host's
// cores) leaves them to it. It gives up when a peer's process has died or
// after `timeout_s`.

#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <climits>
#include <cstdint>
#include <cstdio>

namespace {

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// Whether process `pid` is gone: no /proc entry, or a zombie ('Z') or dead ('X').
// pid 0: not known yet (a rank that has not reached its first barrier).
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  char path[64], buf[256];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  const size_t got = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[got] = '\0';
  // The state follows the command name, which is in parentheses and may hold spaces.
  const char* close = nullptr;
  for (const char* c = buf; *c; ++c)
    if (*c == ')') close = c;
  return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Sleep until *counter (its low 32 bits: the futex word, little-endian) is no longer
// `seen`, or a nap of 10 ms at most has passed.
void sleep_on(int64_t* counter, int64_t seen) {
#ifdef __linux__
  const timespec nap = {0, 10000000};
  syscall(SYS_futex, reinterpret_cast<int32_t*>(counter), FUTEX_WAIT, static_cast<int32_t>(seen), &nap, nullptr, 0);
#else
  const timespec nap = {0, 20000};
  nanosleep(&nap, nullptr);
#endif
}

void wake_sleepers(int64_t* counter) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<int32_t*>(counter), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#endif
}

constexpr double SPIN_S = 50e-6, CHECK_S = 10e-3;

}  // namespace

extern "C" {

// counters: one int64 per rank, `stride` int64s apart; pids: one per rank.
// Returns 0 when every rank has arrived, -1 after timeout_s, or 1 + the rank
// whose process is gone.
int64_t shm_barrier(int64_t* counters, int64_t stride, int64_t rank, int64_t size, int64_t target,
                    const int64_t* pids, double timeout_s) {
  __atomic_store_n(counters + rank * stride, target, __ATOMIC_RELEASE);
  wake_sleepers(counters + rank * stride);
  const double start = now_s();
  double next_check = start + CHECK_S;
  for (int64_t k = 0; k < size; ++k) {
    for (;;) {
      const int64_t seen = __atomic_load_n(counters + k * stride, __ATOMIC_ACQUIRE);
      if (seen >= target) break;
      const double t = now_s();
      if (t - start < SPIN_S) {
        cpu_relax();
        continue;
      }
      if (t >= next_check) {
        // Every rank, not only k: a survivor waiting for a live rank 0 must still
        // notice a lost peer (rank 0 then re-forms the group without answering).
        for (int64_t j = 0; j < size; ++j)
          if (process_gone(pids[j])) return 1 + j;
        if (t - start > timeout_s) return -1;
        next_check = t + CHECK_S;
      }
      sleep_on(counters + k * stride, seen);  // returns at once if the counter moved since `seen`
    }
  }
  return 0;
}

}  // extern "C"
