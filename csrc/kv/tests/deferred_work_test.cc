// Copyright keras_rec_emb authors. Apache-2.0.
// The deferred table work of the JAX binding (jax/table_registry.h,
// AnyTable::Defer / Settle / RunDeferred): an update's table part handed to
// a pool thread runs exactly once, each table's work in program order, its
// effect seen by the next use of the table, its failure raised there once.
// The pool is played by threads calling RunDeferred; TSan runs this too.
// And ShareWork, which splits a call's items among the caller and pool
// threads.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "jax/table_registry.h"
#include "kv/tests/test_util.h"

namespace kre {
namespace jaxbind {
namespace {

std::shared_ptr<AnyTable> MakeTable() {
  kv::TableOptions o;
  o.dim = 4;
  o.default_values.assign(4, 0.0f);
  return std::make_shared<AnyTable>(64, std::move(o));
}

bool StartsWith(const char* s, const char* prefix) {
  return std::strncmp(s, prefix, std::strlen(prefix)) == 0;
}

// Whether t.Settle() throws an E whose message starts with `prefix`.
template <typename E>
bool SettleThrows(AnyTable& t, const char* prefix) {
  try {
    t.Settle();
  } catch (const E& e) {
    return StartsWith(e.what(), prefix);
  }
  return false;
}

// Work settled by the table's next use runs once, before that use goes on.
void TestSettleRunsTheWorkOnce() {
  auto t = MakeTable();
  int runs = 0;
  t->Defer([&runs] { ++runs; });
  CHECK(runs == 0);
  t->Settle();
  CHECK(runs == 1);
  t->Settle();
  t->RunDeferred();  // the pool's task after the caller ran it: nothing left
  CHECK(runs == 1);
}

// Pool threads and the table's user race to settle each deferred work: each
// runs exactly once, in the order deferred, and the user sees it done.
void TestRacingSettlesKeepProgramOrder() {
  auto t = MakeTable();
  constexpr int kWorks = 3000;
  std::vector<int> order;  // written by the works only, read after Settle
  std::atomic<int> scheduled{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> pool;
  for (int w = 0; w < 2; ++w) {
    pool.emplace_back([&] {
      while (!done.load()) {
        if (scheduled.load() > 0) t->RunDeferred();
        std::this_thread::yield();
      }
    });
  }
  bool seen_in_order = true;
  for (int i = 0; i < kWorks; ++i) {
    t->Defer([&order, i] { order.push_back(i); });
    scheduled.fetch_add(1);
    if (i % 7 == 0) {
      t->Settle();  // the table's next use: every work so far done
      seen_in_order = seen_in_order && static_cast<int>(order.size()) == i + 1;
    }
  }
  t->Settle();
  done.store(true);
  for (auto& th : pool) th.join();
  CHECK(seen_in_order);
  CHECK(static_cast<int>(order.size()) == kWorks);
  bool in_order = true;
  for (int i = 0; i < kWorks && i < static_cast<int>(order.size()); ++i) {
    in_order = in_order && order[i] == i;
  }
  CHECK(in_order);
}

// The deferred work changes the table itself: a lookup after Settle sees
// the row it inserted.
void TestTheTableChangeIsSeenAfterSettle() {
  auto t = MakeTable();
  std::thread pool;
  t->Visit([&](auto& tab) {
    using K = KeyOfT<decltype(tab)>;
    t->Defer([&tab] {
      std::vector<K> keys = {7, 8, 9};
      kv::test::Lookup(tab, keys, /*insert=*/true);
    });
    pool = std::thread([t] { t->RunDeferred(); });
    t->Settle();
    CHECK(tab.Size() == 3);
  });
  pool.join();
}

// A work's failure is raised by the table's next Settle, once, named as an
// earlier update's; a file tier's DataLossError stays one.
void TestFailureReachesTheNextUseOnce() {
  auto t = MakeTable();
  t->Defer([] { throw std::runtime_error("disk full"); });
  std::thread pool([t] { t->RunDeferred(); });
  pool.join();
  CHECK(SettleThrows<std::runtime_error>(*t, "an earlier update of this table failed: disk full"));
  CHECK(!SettleThrows<std::exception>(*t, ""));  // once

  t->Defer([] { throw kv::DataLossError("segment truncated"); });
  CHECK(SettleThrows<kv::DataLossError>(*t, "an earlier update of this table failed: segment"));
}

// Deferring while the previous work still runs waits for it (one pending
// work a table): none is lost.
void TestDeferWaitsForTheRunningWork() {
  auto t = MakeTable();
  std::atomic<bool> started{false}, release{false};
  std::atomic<int> runs{0};
  t->Defer([&] {
    started.store(true);
    while (!release.load()) std::this_thread::yield();
    runs.fetch_add(1);
  });
  std::thread pool([t] { t->RunDeferred(); });
  while (!started.load()) std::this_thread::yield();
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    release.store(true);
  });
  t->Defer([&] { runs.fetch_add(10); });  // waits for the first to end
  CHECK(runs.load() == 1);
  t->Settle();
  CHECK(runs.load() == 11);
  pool.join();
  releaser.join();
}

// ShareWork: every item runs exactly once, helpers on pool threads take
// items too, a helper that starts after the call returned touches nothing,
// and an item's exception reaches the caller after every taken item ended.
void TestShareWorkRunsEachItemOnce() {
  constexpr int64_t kItems = 5000;
  std::vector<std::thread> pool;
  std::vector<std::function<void()>> late;  // helpers run after the call
  std::vector<std::atomic<int>> runs(kItems);
  std::atomic<int> on_helpers{0};
  const std::thread::id caller = std::this_thread::get_id();
  ShareWork(
      2,
      [&](std::function<void()> task) {
        if (pool.empty()) {
          pool.emplace_back(std::move(task));
        } else {
          late.push_back(std::move(task));
        }
      },
      kItems,
      [&](int64_t i) {
        runs[i].fetch_add(1);
        if (std::this_thread::get_id() != caller) {
          on_helpers.fetch_add(1);
          return;
        }
        // The caller's items wait (10 s at most) until a helper took one.
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (on_helpers.load() == 0 && std::chrono::steady_clock::now() < until) {
          std::this_thread::yield();
        }
      });
  for (auto& th : pool) th.join();
  for (auto& task : late) task();  // finds no item left
  bool once = true;
  for (auto& r : runs) once = once && r.load() == 1;
  CHECK(once);
  CHECK(late.size() == 1);
  CHECK(on_helpers.load() > 0);
  // No helpers: all on the caller.
  int inline_runs = 0;
  ShareWork(0, [](std::function<void()>) { CHECK(false); }, 3, [&](int64_t) { ++inline_runs; });
  CHECK(inline_runs == 3);

  std::thread helper;
  std::atomic<int> ended{0};
  bool thrown = false;
  try {
    ShareWork(
        1, [&](std::function<void()> task) { helper = std::thread(std::move(task)); }, 64,
        [&](int64_t i) {
          if (i == 5) throw std::runtime_error("item 5 failed");
          ended.fetch_add(1);
        });
  } catch (const std::runtime_error& e) {
    thrown = StartsWith(e.what(), "item 5 failed");
  }
  helper.join();
  CHECK(thrown);
  CHECK(ended.load() == 63);  // the other items still ran
}

}  // namespace
}  // namespace jaxbind
}  // namespace kre

int main() {
  kre::jaxbind::TestSettleRunsTheWorkOnce();
  kre::jaxbind::TestRacingSettlesKeepProgramOrder();
  kre::jaxbind::TestTheTableChangeIsSeenAfterSettle();
  kre::jaxbind::TestFailureReachesTheNextUseOnce();
  kre::jaxbind::TestDeferWaitsForTheRunningWork();
  kre::jaxbind::TestShareWorkRunsEachItemOnce();
  return kre::kv::test::Report("deferred_work_test");
}
