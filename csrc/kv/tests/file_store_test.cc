// Copyright keras_rec_emb authors. Apache-2.0.
// Tests of the file tier (file_store.h): a file-tier table against a DRAM
// table through the same operations (identical exports), snapshots and
// restores, faults (lock, unwritable path, corrupt and truncated files),
// and a writer killed with SIGKILL at random points. Run by `make test`
// (also under ASan and TSan).
#include "kv/file_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kv/crc32c.h"
#include "kv/partition.h"
#include "kv/table.h"
#include "kv/tests/test_util.h"

using Exported = kre::kv::test::Exported<int64_t>;
using kre::kv::BloomSizing;
using kre::kv::DataLossError;
using kre::kv::MakeDirs;
using kre::kv::RemoveTree;

namespace {

constexpr int64_t kDim = 4;
constexpr uint64_t kSegmentBytes = 4096;  // small: many segments

std::string g_root;

std::string TempDir(const std::string& name) {
  const std::string p = g_root + "/" + name;
  std::system(("rm -rf '" + p + "'").c_str());
  return p;
}

TableOptions Options(const std::string& path, int filter) {
  TableOptions o;
  o.dim = kDim;
  o.default_values.resize(5 * kDim);
  for (size_t i = 0; i < o.default_values.size(); ++i) o.default_values[i] = 0.25f * i;
  o.num_shards = 3;
  if (filter == 1) o.filter_freq = 3;
  if (filter == 2) {
    o.filter_freq = 2;
    o.bloom_counters = 4096;
    o.bloom_hashes = 3;
    o.bloom_counter_bytes = 1;
  }
  o.storage_path = path;
  o.cache_bytes = 1;  // the smallest cache: 16 rows per shard
  o.segment_bytes = kSegmentBytes;
  return o;
}

// The positions of `keys` in ascending key order.
std::vector<size_t> KeyOrder(const std::vector<int64_t>& keys) {
  std::vector<size_t> order(keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a] < keys[b]; });
  return order;
}

// Every key, sorted by key.
Exported ExportSorted(const Table<int64_t>& t) {
  const Exported x = ExportAll(t);
  const size_t width = x.keys.empty() ? 0 : x.slots.size() / x.keys.size();
  Exported s;
  for (size_t i : KeyOrder(x.keys)) {
    s.keys.push_back(x.keys[i]);
    s.freqs.push_back(x.freqs[i]);
    s.versions.push_back(x.versions[i]);
    s.values.insert(s.values.end(), x.values.begin() + i * kDim, x.values.begin() + (i + 1) * kDim);
    s.slots.insert(s.slots.end(), x.slots.begin() + i * width, x.slots.begin() + (i + 1) * width);
  }
  for (size_t i : KeyOrder(x.keys_f)) {
    s.keys_f.push_back(x.keys_f[i]);
    s.freqs_f.push_back(x.freqs_f[i]);
    s.versions_f.push_back(x.versions_f[i]);
  }
  return s;
}

// One training step: a lookup with insert, then an Adagrad update of the
// rows with slot "acc" (added at step 0).
std::vector<float> Step(Table<int64_t>& t, int64_t step, int64_t key_range) {
  std::mt19937_64 rng(static_cast<uint64_t>(step) * 7919 + 1);
  std::vector<int64_t> keys(64);
  for (auto& k : keys) k = static_cast<int64_t>(rng() % key_range) - 7;
  const int acc = t.AddSlot("acc", kDim, 0.1f);
  auto p = Partition(t, keys.data(), static_cast<int64_t>(keys.size()), 2, Serial);
  std::vector<float> out(keys.size() * kDim);
  for (int s = 0; s < t.num_shards(); ++s) {
    const int64_t b = p.offsets[s];
    t.Lookup(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, p.offsets[s + 1] - b,
             true, out.data());
  }
  std::vector<float> grads(out.size());
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = 0.01f * out[i] + 0.001f * (i % 7);
  for (int s = 0; s < t.num_shards(); ++s) {
    const int64_t b = p.offsets[s];
    t.Apply(s, p.keys.data() + b, p.hashes.data() + b, p.order.data() + b, p.offsets[s + 1] - b,
            grads.data(), {acc}, step, [&](float* v, float** slots, const float* g) {
              for (int64_t d = 0; d < kDim; ++d) {
                slots[0][d] += g[d] * g[d];
                v[d] -= 0.1f * g[d] / std::sqrt(slots[0][d]);
              }
            });
  }
  return out;
}

void TestSideBySide(int filter) {
  const std::string path = TempDir("side" + std::to_string(filter));
  TableOptions dram_options = Options(path, filter);
  dram_options.storage_path.clear();
  Table<int64_t> dram(dram_options);
  Table<int64_t> file(Options(path, filter));
  CHECK(file.file_tier() && !dram.file_tier());
  for (int64_t step = 0; step < 40; ++step) {
    CHECK(Step(dram, step, 400) == Step(file, step, 400));
    if (step == 20) {
      // A second slot added mid-way: rows on file get its init.
      CHECK(dram.AddSlot("m", 2, 0.5f) == file.AddSlot("m", 2, 0.5f));
    }
    if (step % 10 == 9) CHECK(dram.Evict(-1, 15, -1.0f) == file.Evict(-1, 15, -1.0f));
    if (step == 30) CHECK(dram.Evict(-1, -1, 0.05f) == file.Evict(-1, -1, 0.05f));
  }
  CHECK(dram.Size() == file.Size());
  CHECK(dram.FilteredSize() == file.FilteredSize());
  CHECK(ExportSorted(dram) == ExportSorted(file));
  const auto stats = file.StoreStats();
  CHECK(stats.rows == static_cast<uint64_t>(file.Size()));
  CHECK(stats.cached_rows <= 3 * 16);  // the cache stays bounded
  CHECK(stats.misses > 0 && stats.file_writes > 0 && stats.disk_bytes > 0);
  // Import into both (a merge) and compare again.
  std::vector<int64_t> keys = {1000, 1001, 5};
  std::vector<float> values(3 * kDim, 1.5f), slots(3 * kDim, 2.0f);
  dram.Import(keys.data(), values.data(), nullptr, nullptr, 3, slots.data(), {0}, {kDim});
  file.Import(keys.data(), values.data(), nullptr, nullptr, 3, slots.data(), {0}, {kDim});
  CHECK(ExportSorted(dram) == ExportSorted(file));
  std::vector<float> v;
  int64_t f, ver;
  CHECK(file.Find(1000, &v, &f, &ver) && v == std::vector<float>(kDim, 1.5f));
}

// The bytes of one row's record on file (value and one slot of kDim floats).
constexpr uint64_t kRowBytes = 2 * kDim * 4;

// 300 steps over `key_range` keys, rewriting rows, on a file-tier table
// under TempDir(name) and a DRAM one side by side (and a snapshot of the
// file tier every `snapshot_every` steps when > 0); checks they export the
// same and returns the file tier's store counters.
kre::kv::RowStoreStats RewriteSideBySide(const std::string& name, int64_t key_range,
                                         int snapshot_every) {
  TableOptions o = Options(TempDir(name), 0);
  Table<int64_t> file(o);
  o.storage_path.clear();
  Table<int64_t> dram(o);
  for (int64_t step = 0; step < 300; ++step) {
    CHECK(Step(dram, step, key_range) == Step(file, step, key_range));
    if (snapshot_every > 0 && step % snapshot_every == snapshot_every - 1) file.Snapshot();
  }
  CHECK(ExportSorted(dram) == ExportSorted(file));
  return file.StoreStats();
}

void TestCompaction() {
  // Rows rewritten over and over: without compaction the files would grow
  // with every write-back; with it they stay within a few times the rows.
  // A snapshot every 20 steps seals every segment: rows written back after
  // it are appended, leaving garbage that compaction has to reclaim.
  const auto stats = RewriteSideBySide("compact", 200, 20);
  CHECK(stats.file_writes > 10 * stats.rows);  // rows were rewritten many times
  CHECK(stats.disk_bytes <= 2 * stats.rows * kRowBytes + 3 * kSegmentBytes + 4096);
}

void TestDiskBound() {
  // Without snapshots too a row written back is appended: compaction keeps
  // the files within twice the rows (plus the compaction floor, here one
  // segment, and the segments being filled).
  const auto stats = RewriteSideBySide("bound", 2000, 0);
  CHECK(stats.file_writes > 5 * stats.rows);
  CHECK(stats.disk_bytes <= 2 * stats.rows * kRowBytes + 3 * kSegmentBytes + 4096);
}

void TestSnapshotRestore() {
  const std::string path = TempDir("snap");
  Exported at_snapshot;
  {
    Table<int64_t> t(Options(path, 0));
    for (int64_t step = 0; step < 10; ++step) Step(t, step, 300);
    CHECK(t.Snapshot() == 1);
    at_snapshot = ExportSorted(t);
    for (int64_t step = 10; step < 15; ++step) Step(t, step, 300);
    CHECK(!(ExportSorted(t) == at_snapshot));
    // Restoring into the live table goes back to the snapshot.
    CHECK(t.RestoreSnapshot("") == static_cast<int64_t>(at_snapshot.keys.size()));
    CHECK(ExportSorted(t) == at_snapshot);
    CHECK(t.LatestStep() == 14);  // the latest step never goes back
    for (int64_t step = 15; step < 20; ++step) Step(t, step, 300);
    CHECK(t.Snapshot() == 2);
    CHECK(t.Snapshot() == 3);
  }
  // A new table (after the old one is gone) restores the latest snapshot;
  // only the last two snapshots are kept.
  struct stat st;
  CHECK(::stat((path + "/snap-1").c_str(), &st) != 0);
  CHECK(::stat((path + "/snap-2").c_str(), &st) == 0);
  Table<int64_t> t(Options(path, 0));
  CHECK(t.RestoreSnapshot("") > 0);
  CHECK(t.LatestStep() == 19);
  TableOptions o = Options(path, 0);
  o.storage_path.clear();
  Table<int64_t> dram(o);
  for (int64_t step = 0; step < 20; ++step) {
    if (step == 10) {
      // The reference goes through the same restore: back to step 9's rows.
      dram.Clear();
      for (int64_t s = 0; s < 10; ++s) Step(dram, s, 300);
      continue;
    }
    if (step > 10 && step < 15) continue;
    Step(dram, step, 300);
  }
  CHECK(ExportSorted(dram) == ExportSorted(t));
}

template <typename Fn>
std::string ErrorOf(Fn&& fn);
bool Contains(const std::string& s, const std::string& part);

// A snapshot whose index (32 bytes per key) spans several of the 4 MiB
// buffers it streams through: restored exactly, and a byte flipped past the
// first buffer is caught by the CRC (nothing changed in the table).
void TestBigSnapshot() {
  const std::string path = TempDir("big");
  constexpr int64_t n = 300000;
  std::vector<int64_t> keys(n);
  std::vector<float> values(n * kDim), acc(n * kDim);
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = i * 7 - 1000;
    for (int64_t d = 0; d < kDim; ++d) {
      values[i * kDim + d] = 0.001f * static_cast<float>(i) + d;
      acc[i * kDim + d] = 0.5f + d;
    }
  }
  TableOptions o = Options(path, 0);
  o.cache_bytes = 1 << 20;
  o.segment_bytes = 1 << 20;
  Exported before;
  {
    Table<int64_t> t(o);
    const int slot = t.AddSlot("acc", kDim, 0.1f);
    t.Import(keys.data(), values.data(), nullptr, nullptr, n, acc.data(), {slot}, {kDim});
    CHECK(t.Snapshot() == 1);
    before = ExportSorted(t);
  }
  CHECK(before.keys.size() == static_cast<size_t>(n));
  Table<int64_t> t(o);
  CHECK(t.RestoreSnapshot("") == n);
  CHECK(ExportSorted(t) == before);
  const std::string index = path + "/snap-1/index";
  char c;
  const int fd = ::open(index.c_str(), O_RDWR);
  CHECK(::pread(fd, &c, 1, 6 << 20) == 1);
  c ^= 0x21;
  CHECK(::pwrite(fd, &c, 1, 6 << 20) == 1);
  const std::string err = ErrorOf([&] { t.RestoreSnapshot(""); });
  CHECK(Contains(err, "corrupt") && Contains(err, index));
  CHECK(ExportSorted(t) == before);
  c ^= 0x21;
  CHECK(::pwrite(fd, &c, 1, 6 << 20) == 1);
  ::close(fd);
  CHECK(t.RestoreSnapshot("") == n);
}

template <typename Fn>
std::string ErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// The names in a directory (not . and ..).
std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
  }
  return out;
}

void TestFaults() {
  const std::string path = TempDir("faults");
  {
    Table<int64_t> a(Options(path, 0));
    const std::string e = ErrorOf([&] { Table<int64_t> b(Options(path, 0)); });
    CHECK(Contains(e, "in use by another live table") && Contains(e, path));
    // A staging table beside it (no lock) works.
    TableOptions o = Options(path, 0);
    o.storage_lock = false;
    Table<int64_t> staging(o);
    // Nothing to restore yet.
    CHECK(Contains(ErrorOf([&] { a.RestoreSnapshot(""); }), path + "/CURRENT"));
    for (int64_t step = 0; step < 5; ++step) Step(a, step, 100);
    a.Snapshot();
  }
  // The lock is released with the table.
  {
    Table<int64_t> again(Options(path, 0));
  }
  // A path under a regular file cannot be created.
  const std::string file = path + "/plain";
  std::fclose(std::fopen(file.c_str(), "w"));
  const std::string e = ErrorOf([&] { Table<int64_t> t(Options(file + "/sub", 0)); });
  CHECK(Contains(e, file));
  // A corrupt index: one byte flipped.
  const std::string index = path + "/snap-1/index";
  {
    const int fd = ::open(index.c_str(), O_RDWR);
    char c;
    CHECK(::pread(fd, &c, 1, 40) == 1);
    c ^= 0x5A;
    CHECK(::pwrite(fd, &c, 1, 40) == 1);
    ::close(fd);
    Table<int64_t> t(Options(path, 0));
    const std::string err = ErrorOf([&] { t.RestoreSnapshot(""); });
    CHECK(Contains(err, "corrupt") && Contains(err, index));
    CHECK(t.Size() == 0);  // unchanged
    ::pwrite(::open(index.c_str(), O_RDWR), &(c ^= 0x5A), 1, 40);
    CHECK(t.RestoreSnapshot("") > 0);
  }
  // A truncated segment.
  {
    Table<int64_t> t(Options(path, 0));
    std::string seg;
    for (int s = 0; s < 3 && seg.empty(); ++s) {
      const std::string p = path + "/snap-1/s" + std::to_string(s) + "-0.seg";
      struct stat st;
      if (::stat(p.c_str(), &st) == 0 && st.st_size > 64) seg = p;
    }
    CHECK(!seg.empty());
    // Unlink the shared inode's name and write a shorter copy: the live
    // table's own links (none now) are not touched.
    std::system(
        ("head -c 40 '" + seg + "' > '" + seg + ".x' && mv '" + seg + ".x' '" + seg + "'").c_str());
    const std::string err = ErrorOf([&] { t.RestoreSnapshot(""); });
    CHECK(Contains(err, "truncated") && Contains(err, seg));
    CHECK(t.Size() == 0);
  }
}

// The segment files in the live directory of a table on `path`.
std::vector<std::string> LiveSegments(const std::string& path) {
  std::vector<std::string> out;
  for (const std::string& dir : ListDir(path)) {
    if (dir.rfind("live-", 0) != 0) continue;
    for (const std::string& f : ListDir(path + "/" + dir)) {
      if (f.size() > 4 && f.substr(f.size() - 4) == ".seg")
        out.push_back(path + "/" + dir + "/" + f);
    }
  }
  return out;
}

// Segment files cut short while the table lives (a tool rewriting them, a
// full disk): a read of a row on file throws DataLossError naming the file
// and the offset (it killed the process with SIGBUS when segments were
// read through memory maps); rows in the cache still read, and after a
// restore of a snapshot the table works again.
void TestTruncatedUnderTheTable() {
  const std::string path = TempDir("truncated");
  Table<int64_t> t(Options(path, 0));
  for (int64_t step = 0; step < 10; ++step) Step(t, step, 3000);
  CHECK(t.Snapshot() == 1);
  const Exported at_snapshot = ExportSorted(t);
  for (int64_t step = 10; step < 12; ++step) Step(t, step, 3000);
  // A copy of the snapshot elsewhere (the live segments truncated below
  // are the same files as the snapshot's hard links).
  const std::string copy = TempDir("truncated-copy");
  CHECK(std::system(("mkdir -p '" + copy + "' && cp -r '" + path + "/CURRENT' '" + path +
                     "/snap-1' '" + copy + "/'")
                        .c_str()) == 0);
  const std::vector<std::string> segs = LiveSegments(path);
  CHECK(segs.size() >= 3);
  for (const std::string& seg : segs) CHECK(::truncate(seg.c_str(), 32) == 0);
  std::vector<int64_t> keys(3000);
  std::iota(keys.begin(), keys.end(), -7);
  const std::string err = ErrorOf([&] { Lookup(t, keys, /*insert=*/false); });
  CHECK(Contains(err, "truncated") && Contains(err, path + "/live-") && Contains(err, "offset"));
  bool data_loss = false;
  try {
    ExportAll(t);
  } catch (const DataLossError& e) {
    data_loss = Contains(e.what(), ".seg");
  }
  CHECK(data_loss);
  CHECK(t.RestoreSnapshot(copy) == static_cast<int64_t>(at_snapshot.keys.size()));
  CHECK(ExportSorted(t) == at_snapshot);
  for (int64_t step = 12; step < 20; ++step) Step(t, step, 3000);
}

// Flips one byte of a file at `offset`.
void FlipByte(const std::string& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR);
  char c = 0;
  CHECK(::pread(fd, &c, 1, static_cast<off_t>(offset)) == 1);
  c ^= 0x10;
  CHECK(::pwrite(fd, &c, 1, static_cast<off_t>(offset)) == 1);
  ::close(fd);
}

// Segment records carry CRC-32C checksums: a byte changed in a snapshot's
// segment fails the restore (naming the file and the offset; the table is
// unchanged) where it restored other rows silently; a byte changed in a
// live segment fails the read of that row instead of serving it.
void TestCorruptRecords() {
  static const char kCheck[] = "123456789";
  CHECK(kre::kv::Crc32c(0, kCheck, 9) == 0xE3069283u);  // the standard check value
  CHECK(kre::kv::Crc32c(kre::kv::Crc32c(0, kCheck, 4), kCheck + 4, 5) == 0xE3069283u);
  const std::string path = TempDir("corrupt");
  Exported at_snapshot, other;
  {
    Table<int64_t> t(Options(path, 0));
    for (int64_t step = 0; step < 10; ++step) Step(t, step, 3000);
    CHECK(t.Snapshot() == 1);
    at_snapshot = ExportSorted(t);
  }
  // The snapshot restores into a new table (nothing corrupt yet).
  const std::string other_path = TempDir("corrupt-other");
  Table<int64_t> t(Options(other_path, 0));
  for (int64_t step = 0; step < 3; ++step) Step(t, step, 50);
  other = ExportSorted(t);
  std::vector<std::string> segs;
  for (const std::string& f : ListDir(path + "/snap-1")) {
    if (f.size() > 4 && f.substr(f.size() - 4) == ".seg") segs.push_back(path + "/snap-1/" + f);
  }
  CHECK(!segs.empty());
  // One byte of the last record of the largest segment.
  std::string seg = segs[0];
  struct stat st, big;
  CHECK(::stat(seg.c_str(), &big) == 0);
  for (const std::string& p : segs) {
    if (::stat(p.c_str(), &st) == 0 && st.st_size > big.st_size) {
      seg = p;
      big = st;
    }
  }
  const uint64_t rec = kre::kv::SegmentRecordBytes(2 * kDim);
  CHECK((big.st_size - 32) % rec == 0 && big.st_size > 64);
  const uint64_t last = big.st_size - rec;
  FlipByte(seg, last + 5);
  std::string err = ErrorOf([&] { t.RestoreSnapshot(path); });
  CHECK(Contains(err, "corrupt record at offset " + std::to_string(last)) && Contains(err, seg));
  CHECK(ExportSorted(t) == other);  // unchanged
  // The record's checksum itself.
  FlipByte(seg, last + 5);
  FlipByte(seg, last + rec - 1);
  err = ErrorOf([&] { t.RestoreSnapshot(path); });
  CHECK(Contains(err, "checksum mismatch") && Contains(err, seg));
  CHECK(ExportSorted(t) == other);
  // The header.
  FlipByte(seg, last + rec - 1);
  FlipByte(seg, 9);
  err = ErrorOf([&] { t.RestoreSnapshot(path); });
  CHECK(Contains(err, "corrupt header") && Contains(err, seg));
  CHECK(ExportSorted(t) == other);
  FlipByte(seg, 9);
  CHECK(t.RestoreSnapshot(path) == static_cast<int64_t>(at_snapshot.keys.size()));
  CHECK(ExportSorted(t) == at_snapshot);

  // A byte changed in the live table's files: the read of a row on file
  // throws DataLossError naming the file; rows cached still read.
  for (int64_t step = 10; step < 14; ++step) Step(t, step, 3000);
  const std::vector<std::string> live = LiveSegments(other_path);
  CHECK(!live.empty());
  // Every record of every live segment gets one float changed.
  for (const std::string& p : live) {
    const int fd = ::open(p.c_str(), O_RDWR);
    struct stat fst;
    CHECK(::fstat(fd, &fst) == 0);
    uint64_t width = 0;
    CHECK(::pread(fd, &width, 8, 8) == 8);
    const uint64_t r = kre::kv::SegmentRecordBytes(width);
    for (uint64_t off = 32; off + r <= static_cast<uint64_t>(fst.st_size); off += r) {
      char c;
      CHECK(::pread(fd, &c, 1, static_cast<off_t>(off + 2)) == 1);
      c ^= 0x40;
      CHECK(::pwrite(fd, &c, 1, static_cast<off_t>(off + 2)) == 1);
    }
    ::close(fd);
  }
  std::vector<int64_t> keys(3000);
  std::iota(keys.begin(), keys.end(), -7);
  bool data_loss = false;
  try {
    Lookup(t, keys, /*insert=*/false);
  } catch (const DataLossError& e) {
    data_loss = Contains(e.what(), "corrupt record at offset") && Contains(e.what(), other_path);
  }
  CHECK(data_loss);
}

// Keys of `shard` among 0, 1, 2, ... (the first `n`).
std::vector<int64_t> KeysOfShard(const Table<int64_t>& t, int shard, size_t n) {
  std::vector<int64_t> all(40 * n * static_cast<size_t>(t.num_shards()));
  std::iota(all.begin(), all.end(), 0);
  auto p = Partition(t, all.data(), static_cast<int64_t>(all.size()), 1, Serial);
  CHECK(static_cast<size_t>(p.offsets[shard + 1] - p.offsets[shard]) >= n);
  return std::vector<int64_t>(p.keys.begin() + p.offsets[shard],
                              p.keys.begin() + p.offsets[shard] + static_cast<int64_t>(n));
}

// A restore that fails part-way leaves the table exactly as it was (it
// emptied the shards it had reached). Here the snapshot lies on another
// file system (tmpfs), so its segments are copied into the table's
// directory (a hard link cannot cross), and a file-size limit (a full disk,
// as far as the table can tell) fails the copy of shard 1's segment after
// shard 0's was copied. Within the limit the same restore is exact, and the
// table reads its copies once the snapshot is gone.
void TestRestoreAllOrNothing() {
  struct stat shm, root;
  CHECK(::stat("/dev/shm", &shm) == 0 && ::stat(g_root.c_str(), &root) == 0);
  CHECK(shm.st_dev != root.st_dev);  // the test needs a second file system
  const std::string path = TempDir("all-or-nothing");
  TableOptions o = Options(path, 0);
  o.segment_bytes = 1 << 20;  // one segment per shard
  Exported at_snapshot;
  {
    Table<int64_t> t(o);
    const int slot = t.AddSlot("acc", kDim, 0.1f);
    // Shard 0 gets few rows, the others many: its segment is the smallest.
    std::vector<int64_t> keys = KeysOfShard(t, 0, 10);
    for (int s = 1; s < t.num_shards(); ++s) {
      const std::vector<int64_t> more = KeysOfShard(t, s, 500);
      keys.insert(keys.end(), more.begin(), more.end());
    }
    std::vector<float> values(keys.size() * kDim), acc(keys.size() * kDim, 0.5f);
    for (size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * static_cast<float>(i);
    t.Import(keys.data(), values.data(), nullptr, nullptr, static_cast<int64_t>(keys.size()),
             acc.data(), {slot}, {kDim});
    CHECK(t.Snapshot() == 1);
    at_snapshot = ExportSorted(t);
  }
  char tmpl[] = "/dev/shm/kre-restore-XXXXXX";
  const std::string other = ::mkdtemp(tmpl);
  CHECK(std::system(
            ("cp -r '" + path + "/CURRENT' '" + path + "/snap-1' '" + other + "/'").c_str()) == 0);
  uint64_t shard0 = 0, largest = 0;
  for (const std::string& f : ListDir(other + "/snap-1")) {
    struct stat st;
    if (f.size() < 4 || f.substr(f.size() - 4) != ".seg" ||
        ::stat((other + "/snap-1/" + f).c_str(), &st) != 0) {
      continue;
    }
    largest = std::max<uint64_t>(largest, st.st_size);
    if (f.rfind("s0-", 0) == 0) shard0 = std::max<uint64_t>(shard0, st.st_size);
  }
  CHECK(shard0 > 32 && shard0 < largest);

  TableOptions live = o;
  live.storage_path = TempDir("all-or-nothing-live");
  Table<int64_t> t(live);
  for (int64_t step = 0; step < 3; ++step) Step(t, step, 50);
  CHECK(t.Snapshot() == 1);  // every row on file
  const Exported before = ExportSorted(t);
  const size_t files_before = LiveSegments(live.storage_path).size();
  CHECK(files_before >= 3);
  struct rlimit limit;
  CHECK(::getrlimit(RLIMIT_FSIZE, &limit) == 0);
  const rlim_t saved = limit.rlim_cur;
  ::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
  limit.rlim_cur = shard0;
  CHECK(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
  const std::string err = ErrorOf([&] { t.RestoreSnapshot(other); });
  limit.rlim_cur = saved;
  CHECK(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
  CHECK(Contains(err, "cannot copy the snapshot segment '" + other + "/snap-1/s") &&
        Contains(err, std::strerror(EFBIG)));
  CHECK(ExportSorted(t) == before);                               // every shard as it was
  CHECK(LiveSegments(live.storage_path).size() == files_before);  // the copies removed
  CHECK(t.RestoreSnapshot("") == static_cast<int64_t>(before.keys.size()));
  CHECK(ExportSorted(t) == before);

  CHECK(t.RestoreSnapshot(other) == static_cast<int64_t>(at_snapshot.keys.size()));
  CHECK(ExportSorted(t) == at_snapshot);
  CHECK(std::system(("rm -rf '" + other + "'").c_str()) == 0);
  CHECK(ExportSorted(t) == at_snapshot);  // its own copies
  for (int64_t step = 3; step < 6; ++step) Step(t, step, 3000);
  const Exported trained = ExportSorted(t);
  CHECK(t.Snapshot() == 2);  // syncs the copies
  CHECK(t.RestoreSnapshot("") == static_cast<int64_t>(trained.keys.size()));
  CHECK(ExportSorted(t) == trained);
}

// Descriptors the process holds on files under `path`, and its mappings of
// such files.
int OpenFilesUnder(const std::string& path) {
  int n = 0;
  for (const std::string& fd : ListDir("/proc/self/fd")) {
    char target[4096];
    const ssize_t len = ::readlink(("/proc/self/fd/" + fd).c_str(), target, sizeof(target));
    if (len > 0 && std::string(target, static_cast<size_t>(len)).rfind(path + "/", 0) == 0) ++n;
  }
  return n;
}

int MappingsUnder(const std::string& path) {
  int n = 0;
  FILE* maps = std::fopen("/proc/self/maps", "r");
  char line[8192];
  while (maps != nullptr && std::fgets(line, sizeof(line), maps) != nullptr) {
    if (Contains(line, path + "/")) ++n;
  }
  if (maps != nullptr) std::fclose(maps);
  return n;
}

// Each snapshot seals the segment being written, so rows written after it
// go to a new segment per shard. The table keeps open only the segments it
// appends to and a few per shard for reading, and maps none, however many
// snapshots (it kept every segment open: ~1000 descriptors after 30
// snapshots of 32 shards).
void TestDescriptorsBounded() {
  const std::string path = TempDir("descriptors");
  TableOptions o = Options(path, 0);
  o.segment_bytes = 1 << 20;
  Table<int64_t> t(o);
  o.storage_path.clear();
  Table<int64_t> dram(o);
  const int per_shard = 1 + std::clamp(kre::kv::kTableOpenFiles / t.num_shards(), 2, 16);
  const int bound = t.num_shards() * per_shard + 1;  // and the lock file
  int most = 0;
  for (int64_t step = 0; step < 60; ++step) {
    CHECK(Step(t, step, 3000) == Step(dram, step, 3000));
    CHECK(t.Snapshot() == step + 1);
    most = std::max(most, OpenFilesUnder(path));
  }
  // Rows read back from every segment.
  CHECK(ExportSorted(t) == ExportSorted(dram));
  most = std::max(most, OpenFilesUnder(path));
  const size_t segments = LiveSegments(path).size();
  CHECK(static_cast<int>(segments) > 2 * bound);
  CHECK(most <= bound);
  CHECK(MappingsUnder(path) == 0);
  std::printf("descriptors: at most %d open for %zu segments (bound %d)\n", most, segments, bound);
}

// The writer: restores the latest snapshot if any, then trains step after
// step, snapshotting every 3 steps, until killed.
[[noreturn]] void Writer(const std::string& path) {
  Table<int64_t> t(Options(path, 0));
  struct stat st;
  if (::stat((path + "/CURRENT").c_str(), &st) == 0) t.RestoreSnapshot("");
  for (int64_t step = t.LatestStep() + 1;; ++step) {
    Step(t, step, 500);
    if (step % 3 == 2) t.Snapshot();
  }
}

// The committed snapshot's name, or "" before the first.
std::string CurrentSnapshot(const std::string& path) {
  std::string name;
  FILE* f = std::fopen((path + "/CURRENT").c_str(), "rb");
  if (f == nullptr) return name;
  char buf[256];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) name.append(buf, n);
  std::fclose(f);
  return name;
}

// Each round waits for the writer to commit a snapshot of its own before
// the kill comes at a random moment after it, so every round has something
// new to restore however slow the build (a fixed 20-220 ms left all 8 rounds
// of a TSan build on a loaded machine without one).
void TestKillWriter() {
  const std::string path = TempDir("kill");
  std::mt19937 rng(12345);
  int restored = 0;
  for (int round = 0; round < 8; ++round) {
    const std::string before = CurrentSnapshot(path);
    const pid_t pid = ::fork();
    if (pid == 0) Writer(path);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (CurrentSnapshot(path) == before && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    CHECK(CurrentSnapshot(path) != before);  // the writer committed within 120 s
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 200));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    struct stat st;
    CHECK(::stat((path + "/CURRENT").c_str(), &st) == 0);
    Table<int64_t> t(Options(path, 0));
    const std::string err = ErrorOf([&] { t.RestoreSnapshot(""); });
    CHECK(err.empty());
    if (!err.empty()) std::fprintf(stderr, "restore after kill: %s\n", err.c_str());
    const int64_t last = t.LatestStep();
    CHECK(last % 3 == 2);  // a completed snapshot
    TableOptions o = Options(path, 0);
    o.storage_path.clear();
    Table<int64_t> reference(o);
    for (int64_t step = 0; step <= last; ++step) Step(reference, step, 500);
    CHECK(ExportSorted(reference) == ExportSorted(t));
    ++restored;
  }
  CHECK(restored == 8);
  std::printf("kill -9 rounds restored: %d of 8\n", restored);
}

// Whether `path` names something (a link itself counts, not its target).
bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

void WriteText(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "w");
  CHECK(f != nullptr);
  if (f == nullptr) return;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

std::string ReadText(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return "<missing>";
  char buf[256] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  return std::string(buf, n);
}

// Links planted under storage_path (a stale live-* folder that is a link,
// links inside a stale folder and deeper inside it, links in the table's
// own folder, a snapshot folder and CURRENT.tmp that are links) are
// removed without following them: the files they point to stay.
void TestRemoveNeverFollowsLinks() {
  const std::string victim = TempDir("victim");
  MakeDirs(victim + "/sub");
  WriteText(victim + "/a", "kept a");
  WriteText(victim + "/b", "kept b");
  WriteText(victim + "/sub/c", "kept c");
  auto victim_intact = [&] {
    return ReadText(victim + "/a") == "kept a" && ReadText(victim + "/b") == "kept b" &&
           ReadText(victim + "/sub/c") == "kept c";
  };
  const std::string path = TempDir("nofollow");
  MakeDirs(path + "/live-2-0/deep/deeper");
  CHECK(::symlink(victim.c_str(), (path + "/live-1-0").c_str()) == 0);
  WriteText(path + "/live-2-0/old.seg", "stale");
  CHECK(::symlink(victim.c_str(), (path + "/live-2-0/link").c_str()) == 0);
  CHECK(::symlink((victim + "/a").c_str(), (path + "/live-2-0/file-link").c_str()) == 0);
  CHECK(::symlink(victim.c_str(), (path + "/live-2-0/deep/link").c_str()) == 0);
  CHECK(::symlink(victim.c_str(), (path + "/live-2-0/deep/deeper/link").c_str()) == 0);
  {
    Table<int64_t> t(Options(path, 0));
    CHECK(!Exists(path + "/live-1-0"));  // the link itself is gone
    CHECK(!Exists(path + "/live-2-0"));  // the real stale folder too, links and all
    CHECK(victim_intact());
    // Links in the table's own folder and where a snapshot goes.
    std::string live;
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d)) {
        if (std::strncmp(e->d_name, "live-", 5) == 0) live = path + "/" + e->d_name;
      }
      ::closedir(d);
    }
    CHECK(!live.empty());
    MakeDirs(live + "/nested");
    CHECK(::symlink(victim.c_str(), (live + "/link").c_str()) == 0);
    CHECK(::symlink(victim.c_str(), (live + "/nested/link").c_str()) == 0);
    CHECK(::symlink(victim.c_str(), (path + "/snap-1.tmp").c_str()) == 0);
    CHECK(::symlink(victim.c_str(), (path + "/snap-7").c_str()) == 0);  // past CURRENT
    CHECK(::symlink((victim + "/b").c_str(), (path + "/CURRENT.tmp").c_str()) == 0);
    Step(t, 0, 100);
    CHECK(ErrorOf([&] { t.Snapshot(); }).empty());
    CHECK(!Exists(path + "/snap-7"));
    CHECK(ReadText(path + "/CURRENT") == "snap-1\n");
    CHECK(victim_intact());
    t.Snapshot();  // removes nothing of the victim's either
    CHECK(victim_intact());
    CHECK(!live.empty() && Exists(live + "/link"));
  }
  // The table's own folder went with it, links unlinked.
  bool live_left = false;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) live_left |= std::strncmp(e->d_name, "live-", 5) == 0;
    ::closedir(d);
  }
  CHECK(!live_left);
  CHECK(victim_intact());
  // RemoveTree on a link removes the link only.
  CHECK(::symlink(victim.c_str(), (path + "/direct").c_str()) == 0);
  RemoveTree(path + "/direct");
  CHECK(!Exists(path + "/direct"));
  CHECK(victim_intact());
}

// A status line of this process in kB (VmRSS, VmHWM).
uint64_t StatusKb(const char* field) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kb = 0;
  const size_t len = std::strlen(field);
  while (std::fgets(line, sizeof(line), f)) {
    if (std::strncmp(line, field, len) == 0) kb = std::strtoull(line + len + 1, nullptr, 10);
  }
  std::fclose(f);
  return kb;
}

// A snapshot of a table with a large Bloom filter (160 MB of counters,
// few written) restores its counters exactly, streaming them from the
// index: the restore's peak memory is far below the filter's size, and
// pages of zeros stay unallocated.
void TestSnapshotLargeBloom() {
  const std::string path = TempDir("large-bloom");
  TableOptions o = Options(path, 2);
  BloomSizing(uint64_t{1} << 24, 0.01, &o.bloom_counters, &o.bloom_hashes);
  o.bloom_counter_bytes = 1;
  const uint64_t full = o.bloom_counters;
  Table<int64_t> t(o);
  for (int64_t step = 0; step < 3; ++step) Step(t, step, 500);
  const std::vector<uint8_t> state = t.BloomState();
  CHECK(state.size() == full + 8);
  const int64_t size = t.Size();
  const uint64_t memory = t.MemoryBytes();
  CHECK(memory < full / 4);
  CHECK(t.Snapshot() == 1);
  for (int64_t step = 3; step < 6; ++step) Step(t, step, 5000);
  CHECK(t.BloomState() != state);
  // Peak resident memory from here (writing 5 to clear_refs resets VmHWM).
  if (FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
  const uint64_t before = StatusKb("VmRSS") << 10;
  CHECK(ErrorOf([&] { t.RestoreSnapshot(""); }).empty());
  const uint64_t peak = StatusKb("VmHWM") << 10;
  std::printf("restore of a %.0f MB Bloom filter: peak memory +%.1f MB\n", full / 1e6,
              (peak > before ? peak - before : 0) / 1e6);
  CHECK(peak < before + full / 2);
  CHECK(t.BloomState() == state);
  CHECK(t.Size() == size);
  CHECK(t.MemoryBytes() <= memory + (uint64_t{1} << 20));
}

// RowStore::Prefetch on a store: rows read in runs hold what was written,
// the counters read as if each row had been fetched in turn (one miss, no
// hit at its fetch), it loads no more than the cache holds, write-backs
// that compact the files in the middle of it leave every row right, and
// a failure (files cut short) is left to the row's fetch to report.
void TestPrefetch() {
  const std::string path = TempDir("prefetch");
  MakeDirs(path);
  auto space = std::make_shared<kre::kv::FileSpace>(path, kSegmentBytes);
  // 64 rows of value + one slot (2 * kDim floats) in the cache.
  constexpr uint64_t kCacheRows = 64;
  kre::kv::FileRowStore store(space, 0, kDim, kCacheRows * 2 * kDim * 4, 2);
  constexpr uint32_t kRows = 400;
  std::vector<float> model(kRows * kDim);  // each row's value, as written
  for (uint32_t r = 0; r < kRows; ++r) {
    for (int64_t d = 0; d < kDim; ++d) model[r * kDim + d] = r + 0.25f * d;
    CHECK(store.Allocate(model.data() + r * kDim) == r);
  }
  // A slot: every row is written out and the cache emptied.
  store.ReserveSlot(kDim, 0.5f);
  store.CommitSlot();
  CHECK(store.Stats().cached_rows == 0);
  auto check_row = [&](uint32_t r) {
    const float* v = store.Value(r, /*write=*/false);
    const float* acc = store.Slot(0, r, /*write=*/false);
    for (int64_t d = 0; d < kDim; ++d) {
      CHECK(v[d] == model[r * kDim + d]);
      CHECK(acc[d] == 0.5f);
    }
  };
  std::vector<uint32_t> rows;
  for (uint32_t k = 0; k < 40; ++k) rows.push_back(3 * k + 1);
  rows.push_back(4);  // twice: loaded once
  auto before = store.Stats();
  store.Prefetch(rows.data(), rows.size());
  auto after = store.Stats();
  CHECK(after.misses - before.misses == 40 && after.file_reads - before.file_reads == 40);
  CHECK(after.hits == before.hits && after.cached_rows == 40);
  for (size_t i = 0; i < 40; ++i) check_row(rows[i]);
  before = after;
  after = store.Stats();
  // Each row's Value was its miss, counted by Prefetch; its Slot a hit.
  CHECK(after.misses == before.misses && after.hits - before.hits == 40);
  for (size_t i = 0; i < 40; ++i) check_row(rows[i]);
  CHECK(store.Stats().hits - after.hits == 2 * 40);  // Value and Slot
  // More rows than the cache holds: it loads what fits beside the 40 of
  // them cached (24), every row still reads right.
  rows.clear();
  for (uint32_t r = 0; r < 200; ++r) rows.push_back(r < 40 ? 3 * r + 1 : 200 + r);
  before = store.Stats();
  store.Prefetch(rows.data(), rows.size());
  after = store.Stats();
  CHECK(after.misses - before.misses == kCacheRows - 40 && after.cached_rows == kCacheRows);
  for (uint32_t r : rows) check_row(r);
  // Dirty rows written back while others load, until the files compact.
  std::mt19937_64 rng(3);
  bool compacted = false;
  for (int round = 0; round < 200; ++round) {
    rows.clear();
    for (int k = 0; k < 48; ++k) rows.push_back(static_cast<uint32_t>(rng() % kRows));
    const uint64_t disk = store.Stats().disk_bytes;
    store.Prefetch(rows.data(), rows.size());
    for (uint32_t r : rows) {
      check_row(r);
      float* v = store.Value(r, /*write=*/true);
      v[0] += 1.0f;
      model[r * kDim] += 1.0f;
    }
    compacted = compacted || store.Stats().disk_bytes < disk;
  }
  CHECK(compacted);
  for (uint32_t r = 0; r < kRows; ++r) check_row(r);
  // Files cut short: Prefetch leaves the rows on file uncached, their
  // fetch throws DataLossError.
  store.ReserveSlot(1, 0.0f);  // every row written out, the cache emptied
  store.CommitSlot();
  for (const std::string& f : ListDir(space->dir())) {
    CHECK(::truncate((space->dir() + "/" + f).c_str(), 32) == 0);
  }
  rows = {1, 2, 3};
  store.Prefetch(rows.data(), rows.size());
  CHECK(store.Stats().cached_rows == 0);
  bool data_loss = false;
  try {
    store.Value(2, /*write=*/false);
  } catch (const DataLossError& e) {
    data_loss = Contains(e.what(), "truncated");
  }
  CHECK(data_loss);
}

}  // namespace

int main() {
  char tmpl[] = "/tmp/kre-file-store-XXXXXX";
  g_root = ::mkdtemp(tmpl);
  TestSideBySide(0);
  TestSideBySide(1);
  TestSideBySide(2);
  TestCompaction();
  TestPrefetch();
  TestDiskBound();
  TestSnapshotRestore();
  TestFaults();
  TestRemoveNeverFollowsLinks();
  TestSnapshotLargeBloom();
  TestTruncatedUnderTheTable();
  TestCorruptRecords();
  TestDescriptorsBounded();
  TestRestoreAllOrNothing();
  TestKillWriter();
  TestBigSnapshot();
  std::system(("rm -rf '" + g_root + "'").c_str());
  return kre::kv::test::Report("file_store_test");
}
