// Copyright keras_rec_emb authors. Apache-2.0.
//
// The file tier: a RowStore (row_store.h) whose rows live in append-only
// segment files under a directory, with a bounded DRAM cache of hot rows.
//
// * Files. A table with storage_path P takes an exclusive flock on P/LOCK
//   (a second live table on P fails with an error naming the path) and
//   writes its segments in P/live-<pid>-<n>/ (removed when the table goes;
//   left-overs of a killed process are removed by the next table that
//   takes the lock). A segment holds records of one width (value + slots
//   at the time it was written) after a 32-byte header; a new segment is
//   started when it reaches segment_bytes, when a slot is added, and after
//   each snapshot. Only the segment being appended to is ever written: a
//   segment is immutable once it is left.
// * DRAM. Per row id one 4-byte word (a chunked arena, no growth slack):
//   its record number (each segment owns a range of record numbers, so a
//   number names a segment and an offset), none, or, while the row is
//   cached, its cache slot (the file location then sits with the cache
//   slot, 8 bytes per cached row); the key index and the per-key metadata
//   stay in DRAM (shard_index.h, MetaRows). The cache holds at
//   most max(16, cache_bytes / num_shards / record bytes) rows per shard
//   and replaces by CLOCK (second chance). A dirty row leaving the cache is
//   appended to the current segment (appends are buffered, 1 MiB); its old
//   record becomes garbage (counted in Stats().disk_bytes). When the files
//   hold more than twice the live rows' bytes plus min(segment_bytes,
//   1 MiB), every row on file is copied to new segments (the old ones read
//   in order, 4 MiB at a time) and the old ones are unlinked (a snapshot
//   keeps its own links).
// * Reads. A record is read with pread, never through a memory map: a
//   mapped file that shrinks under the process (a tool truncating it, a
//   full disk) would kill it with SIGBUS at the next read. A record that is
//   not on file whole throws DataLossError naming the file, the offset and
//   the file's size; each record carries a CRC-32C (of its offset and
//   floats), checked at every read from file, so bytes changed on file
//   throw DataLossError naming the file and offset instead of serving
//   other rows (a restore checks every record of the snapshot first).
//   Rows are only appended, never written over their old record: a pwrite
//   of one record costs a file-system metadata update (about 10x a pread
//   here), a buffered append a share of one 1 MiB write. A lookup hands
//   the store its rows first (Prefetch): the misses are read sorted by
//   record, and records of one segment at most kReadGapBytes apart with one
//   pread (up to kReadRunBytes): benchmarks/bound/file_probe.cc reads
//   5-10% of a page-cached file's records fastest with a 4 KiB gap (a
//   pread's fixed cost buys about that much copying here).
// * Descriptors. Only the segment being appended to keeps its file open.
//   Reads of the other segments go through a few open files per shard
//   (open_files, 2 to 16: kTableOpenFiles split over the shards; the least
//   recently used is closed first), so a table holds a bounded number of
//   descriptors however many segments and snapshots there are, and maps
//   none.
// * Snapshot (Table::Snapshot): every shard locked, dirty rows written,
//   segments flushed, fsynced and left; the segments are hard-linked into
//   P/snap-<seq>.tmp/ with an index file (keys, locations, frequencies,
//   versions, slot specs, initializer matrix, Bloom state; CRC-32 at the
//   end), fsynced, renamed to P/snap-<seq>, and P/CURRENT (the name of the
//   latest snapshot) replaced by an atomic rename. Segments are never
//   written once left and a snapshot holds its own links, so a kill -9 at
//   any point leaves the previous snapshot intact; the snapshot before the
//   latest is kept as well, older ones removed.
#ifndef KRE_KV_FILE_STORE_H_
#define KRE_KV_FILE_STORE_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kv/row_store.h"

namespace kre {
namespace kv {

// The exclusive lock of a storage path (flock on P/LOCK, released when the
// process dies). Throws std::runtime_error naming the path when the path
// cannot be created or written, or another live table holds it.
class StorageLock {
 public:
  explicit StorageLock(const std::string& path);
  ~StorageLock();
  StorageLock(const StorageLock&) = delete;
  StorageLock& operator=(const StorageLock&) = delete;

 private:
  int fd_ = -1;
};

// One table's working directory P/live-<pid>-<n>; removed with its files
// when the last store that uses it goes.
class FileSpace {
 public:
  FileSpace(const std::string& root, uint64_t segment_bytes);
  ~FileSpace();
  const std::string& dir() const { return dir_; }
  const std::string& root() const { return root_; }
  uint64_t segment_bytes() const { return segment_bytes_; }

 private:
  std::string root_;
  std::string dir_;
  uint64_t segment_bytes_;
};

// Creates a directory and its parents; throws naming it on failure.
void MakeDirs(const std::string& path);
// Removes P/live-* directories (under the lock: no live table uses them).
void RemoveStaleLiveDirs(const std::string& root);
// Removes `path` and what it holds without following a symbolic link: a
// link (`path` itself or one inside) is unlinked, never descended, so the
// files it points to stay. Failures are ignored (best effort).
void RemoveTree(const std::string& path);

constexpr uint64_t kNoLocation = ~uint64_t{0};

// Segment files a table keeps open for reading, split over its shards
// (each keeps 2 to 16; see FileRowStore's open_files).
constexpr int kTableOpenFiles = 64;

// Segment files: a 32-byte header (magic, floats per record, dim, CRC-32C
// of those 24 bytes), then records of `width` floats each followed by the
// CRC-32C of the record's offset and floats (checked at every read from
// file, in compaction and by VerifySegment).
constexpr uint64_t kSegmentHeaderBytes = 32;
inline uint64_t SegmentRecordBytes(uint64_t width) { return width * 4 + 4; }

// Checks a segment file of a snapshot before it is restored: its header
// (format, width, dim), that it holds `size` bytes of whole records, and
// every record's checksum. Throws DataLossError naming the file (and the
// offset of a corrupt record), std::runtime_error when it cannot be read or
// is of an older format.
void VerifySegment(const std::string& path, uint64_t width, uint64_t size, int64_t dim);

class FileRowStore final : public RowStore {
 public:
  // open_files: segment files kept open for reading (at least 1).
  FileRowStore(std::shared_ptr<FileSpace> space, int shard, int64_t dim, uint64_t cache_bytes,
               int open_files);
  // Removes the store's segment files.
  ~FileRowStore() override;

  uint32_t Allocate(const float* init) override;
  void Release(uint32_t row) override;
  float* Value(uint32_t row, bool write) override { return Fetch(row, write); }
  float* Slot(size_t j, uint32_t row, bool write) override {
    return Fetch(row, write) + slot_offsets_[j];
  }
  void Read(uint32_t row, float* value, float* slots) const override;
  // Loads the rows given that are not cached (at most what the cache holds
  // besides those that are): sorted by record, neighbours in a segment
  // (kReadGapBytes apart at most) read with one pread. Each counts its miss
  // here and no hit at its next Fetch, so the counters read as if every
  // row had been fetched in turn.
  void Prefetch(const uint32_t* rows, size_t n) override;
  void ReserveSlot(int64_t width, float init) override;
  void CommitSlot() override;
  void SetSlotInit(size_t j, float init) override { inits_[j] = init; }
  void Sync() override;
  void Clear() override;
  bool stable_pointers() const override { return false; }
  RowStoreStats Stats() const override;

  // Snapshot support. Seal: Sync, then the next write starts a new segment.
  void Seal();
  uint64_t Location(uint32_t row) const { return Loc(row); }
  struct SegmentInfo {
    uint32_t id;
    std::string path;
    uint64_t size;   // bytes, header included
    uint64_t width;  // floats per record
  };
  std::vector<SegmentInfo> Segments() const;
  // Restore support: links `path` (a segment of `width` floats per record,
  // `size` bytes) into this store's directory, or copies it when it cannot
  // be linked (another file system); returns its new id. Throws naming the
  // file (nothing added then).
  uint32_t AdoptSegment(const std::string& path, uint64_t width, uint64_t size);
  // Numbers this store's new segments after those of `other`, a store in
  // the same directory, so that their file names differ.
  void NumberAfter(const FileRowStore& other) {
    next_segment_ = std::max(next_segment_, other.next_segment_);
  }
  // A new row whose record is at `location` (of an adopted segment).
  uint32_t AdoptRow(uint64_t location);
  // Sets the slot layout of an empty store.
  void SetLayout(const std::vector<int64_t>& widths, const std::vector<float>& inits);

 private:
  struct Segment {
    // Open while the segment is appended to (read and written through it);
    // -1 once left: reads then go through SegmentFile.
    int fd = -1;
    std::string path;
    uint64_t width = 0;      // floats per record
    uint64_t rec_bytes = 0;  // bytes per record on file
    uint64_t size = 0;       // bytes on file
    // Written since the last Sync (to be fsynced by it).
    bool unsynced = false;
    // Its record numbers: [base, base + cap).
    uint32_t base = 0;
    uint32_t cap = 0;
  };
  // A segment's file, open for reading while this lives: the segment's
  // own descriptor while it is appended to, else one of the store's open
  // files (opened on a miss in place of the least recently used one, and
  // pinned meanwhile), or, when concurrent readers pin them all, a
  // descriptor of its own. Throws naming the file when it cannot be opened.
  class SegmentFile {
   public:
    SegmentFile(const FileRowStore& store, uint32_t id, const Segment& seg);
    ~SegmentFile();
    SegmentFile(const SegmentFile&) = delete;
    SegmentFile& operator=(const SegmentFile&) = delete;
    int fd() const { return fd_; }

   private:
    const FileRowStore& store_;
    int fd_ = -1;
    int entry_ = -1;  // in open_files_, or -1
    bool own_ = false;
  };
  struct OpenFile {
    uint32_t id = UINT32_MAX;  // segment, UINT32_MAX when unused
    int fd = -1;
    uint32_t pins = 0;  // SegmentFiles using it
    uint64_t used = 0;  // files_clock_ at its last use
  };
  // Closes the open file of segment `id`, or every one (exclusive lock: no
  // SegmentFile uses them).
  void CloseFile(uint32_t id);
  void CloseFiles();
  float* Fetch(uint32_t row, bool write);
  // Per-row word (where_): kNoWord, kCached | cache slot while the row is
  // cached (then its file location is cache_loc_[slot]), or else a record
  // number (< 2^31): segments own disjoint ranges of record numbers
  // (Segment::base, cap; by_base_), record base + i being the segment's
  // i-th record. Locations outside (segment << 40 | offset) stay 64-bit.
  static constexpr uint32_t kNoWord = UINT32_MAX;
  static constexpr uint32_t kCached = uint32_t{1} << 31;
  static bool IsCached(uint32_t w) { return w != kNoWord && (w & kCached) != 0; }
  uint64_t WordToLoc(uint32_t w) const;
  uint32_t LocToWord(uint64_t loc) const;
  int32_t SlotOf(uint32_t row) const {
    const uint32_t w = *where_.Row(row);
    return IsCached(w) ? static_cast<int32_t>(w & ~kCached) : -1;
  }
  uint64_t Loc(uint32_t row) const {
    const uint32_t w = *where_.Row(row);
    return IsCached(w) ? cache_loc_[w & ~kCached] : WordToLoc(w);
  }
  void SetLoc(uint32_t row, uint64_t loc) {
    uint32_t* w = where_.Row(row);
    if (IsCached(*w)) {
      cache_loc_[*w & ~kCached] = loc;
    } else {
      *w = LocToWord(loc);
    }
  }
  // Puts `row` (file location `loc`) in cache slot `slot`, and takes it out.
  void Cache(uint32_t row, uint32_t slot, uint64_t loc) {
    cache_loc_[slot] = loc;
    cache_row_[slot] = row;
    *where_.Row(row) = kCached | slot;
  }
  void Uncache(uint32_t slot) {
    *where_.Row(cache_row_[slot]) = LocToWord(cache_loc_[slot]);
    cache_row_[slot] = kNoRow;
  }
  // Record-number ranges: a free range of n numbers (throws when none is
  // left), and giving one back.
  uint32_t TakeRange(uint32_t n);
  void GiveRange(uint32_t start, uint32_t n);
  // Registers a new segment (its range of record numbers) and removes one.
  void AddSegment(uint32_t id, Segment seg, uint64_t records);
  // Counts and adds a segment file just opened (`records` record numbers
  // for it); if that fails, closes and removes the file and leaves the
  // store as it was.
  void RegisterSegment(uint32_t id, Segment seg, uint64_t records);
  void RemoveSegment(uint32_t id);
  uint32_t TakeCacheSlot();
  void WriteBack(uint32_t slot);
  // Appends a record to the buffer of the current segment (starting a new
  // segment first when it is full or of another width) and returns its
  // location; the buffer is written out by FlushBuffer.
  uint64_t Append(const float* record);
  void FlushBuffer();
  void OpenSegment();
  // The file name of segment `id` in this store's directory.
  std::string SegmentPath(uint32_t id) const;
  // Creates the next free segment file exclusively; returns its id, its
  // path and descriptor in `path` and `fd`. Throws naming the file.
  uint32_t NewSegmentFile(std::string* path, int* fd);
  // Flushes the current segment and leaves it: the next append starts a
  // new one.
  void LeaveActive();
  // Reads the record at `loc` into dst (width_ floats; slots added after it
  // was written get their init values). Throws DataLossError when the file
  // does not hold it whole.
  void ReadRecord(uint64_t loc, float* dst) const;
  // Gives a record read from file (`seg`'s at `offset`, in `src`) to dst as
  // ReadRecord does.
  void UnpackRecord(const Segment& seg, uint64_t offset, const char* src, float* dst) const;
  void EnsureRowCapacity(uint32_t rows);
  // Drops the file bytes of `loc` from the live count.
  void Forget(uint64_t loc);
  void MaybeCompact();
  // Copies every row on file to new segments and unlinks the old ones.
  void Compact();
  void Recompute();
  // Empties the DRAM cache (its rows must be clean or be discarded): no row
  // is cached any more and the cache's memory is freed. keep_rows = false
  // when every row goes (Clear): their words are not restored.
  void DropCache(bool keep_rows = true);

  std::shared_ptr<FileSpace> space_;
  int shard_;
  int64_t dim_;
  uint64_t cache_bytes_;
  int64_t width_;  // dim + slot widths
  std::vector<int64_t> widths_;
  std::vector<float> inits_;
  std::vector<int64_t> slot_offsets_;
  int64_t pending_width_ = 0;
  float pending_init_ = 0;
  // Rows.
  ChunkedArena<uint32_t> where_{1};
  std::map<uint32_t, uint32_t> by_base_;      // range start -> segment id
  std::map<uint32_t, uint32_t> free_ranges_;  // start -> length
  std::vector<uint32_t> free_rows_;
  uint32_t next_row_ = 0;
  uint64_t rows_ = 0;
  // Cache.
  uint64_t capacity_ = 16;
  std::vector<float> cache_;
  std::vector<uint32_t> cache_row_;
  std::vector<uint64_t> cache_loc_;  // file location of each cached row
  // ref_: kReferenced (CLOCK's bit), plus kAhead while a row loaded by
  // Prefetch has not been fetched yet (its miss is counted).
  static constexpr uint8_t kReferenced = 1;
  static constexpr uint8_t kAhead = 2;
  std::vector<uint8_t> ref_, dirty_;
  std::vector<uint32_t> free_slots_;
  uint64_t hand_ = 0;
  // Files.
  std::map<uint32_t, Segment> segments_;
  uint32_t next_segment_ = 0;
  int64_t active_ = -1;       // segment being appended to
  std::vector<char> buffer_;  // its unflushed tail
  uint64_t file_bytes_ = 0;   // all segment bytes, the buffer included
  uint64_t live_bytes_ = 0;   // bytes of the records rows point at
  bool compacting_ = false;
  // Open files of segments not appended to (SegmentFile). Read() runs under
  // a shared lock, so concurrent readers share them under files_mu_.
  mutable std::mutex files_mu_;
  mutable std::vector<OpenFile> open_files_;  // sized once: entries stay put
  mutable uint64_t files_clock_ = 0;
  // Counters.
  uint64_t compactions_ = 0;
  uint64_t hits_ = 0, misses_ = 0, reads_ = 0, writes_ = 0;
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_FILE_STORE_H_
