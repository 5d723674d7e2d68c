// Copyright keras_rec_emb authors. Apache-2.0.
// The deferred table work of the JAX binding (jax/table_registry.h,
// AnyTable::Defer / Settle / RunDeferred): an update's table part handed to
// a pool thread runs exactly once, each table's work in program order, its
// effect seen by the next use of the table, its failure raised there once.
// The pool is played by threads calling RunDeferred; TSan runs this too.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
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

}  // namespace
}  // namespace jaxbind
}  // namespace kre

int main() {
  kre::jaxbind::TestSettleRunsTheWorkOnce();
  kre::jaxbind::TestRacingSettlesKeepProgramOrder();
  kre::jaxbind::TestTheTableChangeIsSeenAfterSettle();
  kre::jaxbind::TestFailureReachesTheNextUseOnce();
  kre::jaxbind::TestDeferWaitsForTheRunningWork();
  return kre::kv::test::Report("deferred_work_test");
}
