// Copyright keras_rec_emb authors. Apache-2.0.
#include "kv/file_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "kv/crc32c.h"

namespace kre {
namespace kv {

namespace {

// Format 02: every record carries a CRC-32C (format 01, without, is refused).
constexpr char kSegmentMagic[8] = {'K', 'R', 'E', 'S', 'E', 'G', '0', '2'};
constexpr char kSegmentMagicV1[8] = {'K', 'R', 'E', 'S', 'E', 'G', '0', '1'};
constexpr uint64_t kHeaderBytes = kSegmentHeaderBytes;
constexpr size_t kBufferBytes = 1 << 20;
constexpr uint64_t kOffsetBits = 40;
constexpr uint64_t kOffsetMask = (uint64_t{1} << kOffsetBits) - 1;
// Compaction and restores read segments this much at a time.
constexpr uint64_t kChunkBytes = 4 << 20;
// Garbage a shard may hold beyond its live bytes before it compacts (at
// most segment_bytes): a small table is not compacted at every write-back.
constexpr uint64_t kCompactFloorBytes = 1 << 20;
// Records up to this size are read through a buffer on the stack.
constexpr uint64_t kStackRecordBytes = 2048;
// Prefetch: records of a segment this close (bytes from the end of one to
// the start of the next) are read with one pread, of at most kReadRunBytes
// (one record more when a record is larger).
constexpr uint64_t kReadGapBytes = 4 << 10;
constexpr uint64_t kReadRunBytes = 256 << 10;
// Directory levels RemoveTree descends (tables write none below their own
// folders): deeper ones are left, which bounds its stack and descriptors.
constexpr int kRemoveDepth = 16;

uint64_t RecordBytes(uint64_t width) { return SegmentRecordBytes(width); }

// A record's checksum: CRC-32C of its offset in the segment (so a record
// copied to another place does not pass) and its floats.
uint32_t RecordCrc(uint64_t offset, const char* values, uint64_t n) {
  return Crc32c(Crc32c(0, &offset, sizeof(offset)), values, n);
}

// The checksum stored after a record's floats.
uint32_t StoredCrc(const char* record, uint64_t width) {
  uint32_t crc;
  std::memcpy(&crc, record + width * 4, 4);
  return crc;
}

DataLossError CorruptRecord(const std::string& path, uint64_t offset, uint32_t stored,
                            uint32_t computed) {
  char hex[64];
  std::snprintf(hex, sizeof(hex), "stored 0x%08x, computed 0x%08x", stored, computed);
  return DataLossError("the file-tier segment '" + path + "' holds a corrupt record at offset " +
                       std::to_string(offset) + " (checksum mismatch: " + hex +
                       "): the file was changed after it was written");
}

std::runtime_error IoError(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " '" + path + "': " + std::strerror(errno));
}

void WriteAll(int fd, const char* p, size_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError("cannot write the file-tier segment", path);
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

// Reads n bytes at `offset` of a segment. Bytes the file does not hold (it
// was truncated under the table) throw DataLossError naming the file, the
// offset and the file's size; a failed read throws std::runtime_error.
void ReadRecordBytes(int fd, char* p, size_t n, uint64_t offset, const std::string& path) {
  const uint64_t start = offset;
  const size_t total = n;
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw IoError("cannot read the file-tier segment", path);
    if (r == 0) {
      struct stat st;
      const std::string size =
          ::fstat(fd, &st) == 0 ? std::to_string(st.st_size) + " bytes" : "unknown";
      throw DataLossError("the file-tier segment '" + path + "' was truncated under the table: " +
                          std::to_string(total) + " bytes at offset " + std::to_string(start) +
                          " are past its end (file size " + size +
                          "); rows on file are lost (restore a snapshot or a checkpoint)");
    }
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

// Copies the first `size` bytes of segment file `src` to a new file `dst`
// (removed again if the copy fails); the error names both.
void CopySegmentFile(const std::string& src, const std::string& dst, uint64_t size) {
  const int in = ::open(src.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) throw IoError("cannot open the snapshot segment", src);
  int out = ::open(dst.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (out < 0) {
    const int err = errno;
    ::close(in);
    errno = err;
    throw IoError("cannot create the file-tier segment", dst);
  }
  try {
    std::vector<char> chunk(static_cast<size_t>(std::min<uint64_t>(size, kChunkBytes)));
    for (uint64_t offset = 0; offset < size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), size - offset));
      ReadRecordBytes(in, chunk.data(), n, offset, src);
      WriteAll(out, chunk.data(), n, offset, dst);
      offset += n;
    }
    const int rc = ::close(out);
    out = -1;
    if (rc != 0) throw IoError("cannot write the file-tier segment", dst);
  } catch (const std::exception& e) {
    ::close(in);
    if (out >= 0) ::close(out);
    ::unlink(dst.c_str());
    throw std::runtime_error("cannot copy the snapshot segment '" + src +
                             "' into the table's directory (it could not be hard-linked: "
                             "another file system): " +
                             e.what());
  }
  ::close(in);
}

std::atomic<uint64_t> g_space_counter{0};

// Sorts by the upper 32 bits (a least-significant-digit radix sort, 8 bits
// a pass; stable): a lookup's misses are a few thousand a shard, where
// std::sort's comparisons cost several times more.
void SortByHigh32(std::vector<uint64_t>* v) {
  std::vector<uint64_t> tmp(v->size());
  for (int shift = 32; shift < 64; shift += 8) {
    size_t count[257] = {};
    for (const uint64_t x : *v) ++count[((x >> shift) & 0xFF) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (const uint64_t x : *v) tmp[count[(x >> shift) & 0xFF]++] = x;
    v->swap(tmp);
  }
}

// Removes the entries of the directory open as `dir` (closed here), then
// `depth` levels below it at most; a symbolic link is unlinked, never
// followed, so a link planted in a directory being removed cannot make
// the removal reach outside it.
void RemoveEntriesAt(int dir, int depth) {
  DIR* d = ::fdopendir(dir);
  if (d == nullptr) {
    ::close(dir);
    return;
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  for (const auto& name : names) {
    if (::unlinkat(dir, name.c_str(), 0) == 0 || errno == ENOENT) continue;
    // EISDIR (Linux) or EPERM (POSIX): a real directory, opened without
    // following a link that may have replaced it since.
    if (depth > 0) {
      const int sub = ::openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub >= 0) RemoveEntriesAt(sub, depth - 1);
    }
    ::unlinkat(dir, name.c_str(), AT_REMOVEDIR);
  }
  ::closedir(d);  // closes `dir`
}

}  // namespace

void RemoveTree(const std::string& path) {
  // The path itself may be a link (a planted P/live-*): unlinked, not
  // descended.
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (!S_ISDIR(st.st_mode)) {
    ::unlink(path.c_str());
    return;
  }
  const int dir = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir >= 0) RemoveEntriesAt(dir, kRemoveDepth);
  ::rmdir(path.c_str());
}

void MakeDirs(const std::string& path) {
  if (path.empty()) throw std::invalid_argument("storage_path must not be empty");
  size_t pos = 0;
  while (true) {
    pos = path.find('/', pos + 1);
    const std::string part = path.substr(0, pos);
    if (!part.empty() && ::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) {
      throw IoError("cannot create the storage directory", part);
    }
    if (pos == std::string::npos) break;
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    errno = ENOTDIR;
    throw IoError("storage_path is not a directory", path);
  }
  if (::access(path.c_str(), W_OK | X_OK) != 0) {
    throw IoError("storage_path is not writable", path);
  }
}

void RemoveStaleLiveDirs(const std::string& root) {
  if (DIR* d = ::opendir(root.c_str())) {
    std::vector<std::string> stale;
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind("live-", 0) == 0) stale.push_back(root + "/" + name);
    }
    ::closedir(d);
    for (const auto& p : stale) RemoveTree(p);
  }
}

StorageLock::StorageLock(const std::string& path) {
  MakeDirs(path);
  const std::string lock = path + "/LOCK";
  fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError("cannot create the lock file of storage_path", lock);
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error("storage_path '" + path +
                             "' is in use by another live table (its lock file '" + lock +
                             "' is held); give each table its own storage_path");
  }
  RemoveStaleLiveDirs(path);
}

StorageLock::~StorageLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

FileSpace::FileSpace(const std::string& root, uint64_t segment_bytes)
    : root_(root), segment_bytes_(segment_bytes) {
  MakeDirs(root);
  dir_ = root + "/live-" + std::to_string(::getpid()) + "-" +
         std::to_string(g_space_counter.fetch_add(1));
  if (::mkdir(dir_.c_str(), 0755) != 0) throw IoError("cannot create", dir_);
}

FileSpace::~FileSpace() { RemoveTree(dir_); }

FileRowStore::FileRowStore(std::shared_ptr<FileSpace> space, int shard, int64_t dim,
                           uint64_t cache_bytes, int open_files)
    : space_(std::move(space)),
      shard_(shard),
      dim_(dim),
      cache_bytes_(cache_bytes),
      width_(dim),
      open_files_(static_cast<size_t>(std::max(1, open_files))) {
  free_ranges_[0] = kCached;  // record numbers [0, 2^31)
  Recompute();
}

FileRowStore::SegmentFile::SegmentFile(const FileRowStore& store, uint32_t id, const Segment& seg)
    : store_(store) {
  if (seg.fd >= 0) {
    fd_ = seg.fd;
    return;
  }
  std::lock_guard<std::mutex> lock(store.files_mu_);
  int victim = -1;
  for (size_t i = 0; i < store.open_files_.size(); ++i) {
    OpenFile& f = store.open_files_[i];
    if (f.id == id) {
      ++f.pins;
      f.used = ++store.files_clock_;
      fd_ = f.fd;
      entry_ = static_cast<int>(i);
      return;
    }
    if (f.pins == 0 && (victim < 0 || f.used < store.open_files_[victim].used)) {
      victim = static_cast<int>(i);
    }
  }
  fd_ = ::open(seg.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw IoError("cannot open the file-tier segment", seg.path);
  if (victim < 0) {
    own_ = true;
    return;
  }
  OpenFile& f = store.open_files_[victim];
  if (f.fd >= 0) ::close(f.fd);
  f = OpenFile{id, fd_, 1, ++store.files_clock_};
  entry_ = victim;
}

FileRowStore::SegmentFile::~SegmentFile() {
  if (own_) {
    ::close(fd_);
  } else if (entry_ >= 0) {
    std::lock_guard<std::mutex> lock(store_.files_mu_);
    --store_.open_files_[entry_].pins;
  }
}

void FileRowStore::CloseFile(uint32_t id) {
  std::lock_guard<std::mutex> lock(files_mu_);
  for (OpenFile& f : open_files_) {
    if (f.id != id) continue;
    ::close(f.fd);
    f = OpenFile{};
  }
}

void FileRowStore::CloseFiles() {
  std::lock_guard<std::mutex> lock(files_mu_);
  for (OpenFile& f : open_files_) {
    if (f.fd >= 0) ::close(f.fd);
    f = OpenFile{};
  }
}

uint32_t FileRowStore::TakeRange(uint32_t n) {
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    if (it->second < n) continue;
    const uint32_t start = it->first;
    const uint32_t len = it->second;
    free_ranges_.erase(it);
    if (len > n) free_ranges_[start + n] = len - n;
    return start;
  }
  throw std::runtime_error("the file tier's shard " + std::to_string(shard_) + " under '" +
                           space_->root() +
                           "' has no record numbers left (2^31 records on file per shard); "
                           "use more shards");
}

void FileRowStore::GiveRange(uint32_t start, uint32_t n) {
  auto next = free_ranges_.lower_bound(start);
  if (next != free_ranges_.end() && start + n == next->first) {
    n += next->second;
    next = free_ranges_.erase(next);
  }
  if (next != free_ranges_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      prev->second += n;
      return;
    }
  }
  free_ranges_[start] = n;
}

void FileRowStore::AddSegment(uint32_t id, Segment seg, uint64_t records) {
  seg.cap = static_cast<uint32_t>(std::min<uint64_t>(std::max<uint64_t>(records, 1), kCached));
  seg.base = TakeRange(seg.cap);
  by_base_[seg.base] = id;
  segments_[id] = seg;
}

void FileRowStore::RemoveSegment(uint32_t id) {
  const auto it = segments_.find(id);
  if (it == segments_.end()) return;
  if (it->second.fd >= 0) ::close(it->second.fd);
  CloseFile(id);
  GiveRange(it->second.base, it->second.cap);
  by_base_.erase(it->second.base);
  segments_.erase(it);
}

uint64_t FileRowStore::WordToLoc(uint32_t w) const {
  if (w == kNoWord) return kNoLocation;
  auto it = by_base_.upper_bound(w);
  if (it == by_base_.begin()) throw std::runtime_error("file-tier row in a missing segment");
  --it;
  const auto seg = segments_.find(it->second);
  if (seg == segments_.end()) throw std::runtime_error("file-tier row in a missing segment");
  return (static_cast<uint64_t>(it->second) << kOffsetBits) |
         (kHeaderBytes + static_cast<uint64_t>(w - seg->second.base) * seg->second.rec_bytes);
}

uint32_t FileRowStore::LocToWord(uint64_t loc) const {
  if (loc == kNoLocation) return kNoWord;
  const auto seg = segments_.find(static_cast<uint32_t>(loc >> kOffsetBits));
  if (seg == segments_.end()) throw std::runtime_error("file-tier row in a missing segment");
  const uint64_t offset = loc & kOffsetMask;
  return seg->second.base + static_cast<uint32_t>((offset - kHeaderBytes) / seg->second.rec_bytes);
}

FileRowStore::~FileRowStore() {
  // A store owns its segment files: they go with it, also when its
  // directory outlives it (the store a restore replaced, while the table
  // lives on with new stores in the same directory). A snapshot keeps its
  // own links to them.
  for (auto& kv : segments_) {
    if (kv.second.fd >= 0) ::close(kv.second.fd);
    ::unlink(kv.second.path.c_str());
  }
  CloseFiles();
}

void FileRowStore::Recompute() {
  slot_offsets_.assign(widths_.size(), 0);
  int64_t off = dim_;
  for (size_t j = 0; j < widths_.size(); ++j) {
    slot_offsets_[j] = off;
    off += widths_[j];
  }
  width_ = off;
  capacity_ = std::max<uint64_t>(16, cache_bytes_ / (static_cast<uint64_t>(width_) * 4));
  // Bounded by the 31-bit cache slot numbers.
  capacity_ = std::min<uint64_t>(capacity_, INT32_MAX - 1);
}

void FileRowStore::EnsureRowCapacity(uint32_t rows) { where_.EnsureCapacity(rows, kNoWord); }

std::string FileRowStore::SegmentPath(uint32_t id) const {
  return space_->dir() + "/s" + std::to_string(shard_) + "-" + std::to_string(id) + ".seg";
}

uint32_t FileRowStore::NewSegmentFile(std::string* path, int* fd) {
  // Exclusive create: a name already taken in the directory (another store
  // of it numbered alike) is skipped, never truncated.
  for (;;) {
    const uint32_t id = next_segment_++;
    *path = SegmentPath(id);
    *fd = ::open(path->c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (*fd >= 0) return id;
    if (errno != EEXIST) throw IoError("cannot create the file-tier segment", *path);
  }
}

void FileRowStore::OpenSegment() {
  LeaveActive();
  Segment seg;
  const uint32_t id = NewSegmentFile(&seg.path, &seg.fd);
  seg.width = static_cast<uint64_t>(width_);
  seg.rec_bytes = RecordBytes(seg.width);
  char header[kHeaderBytes] = {};
  std::memcpy(header, kSegmentMagic, 8);
  std::memcpy(header + 8, &seg.width, 8);
  const uint64_t dim = static_cast<uint64_t>(dim_);
  std::memcpy(header + 16, &dim, 8);
  const uint32_t header_crc = Crc32c(0, header, 24);
  std::memcpy(header + 24, &header_crc, 4);
  try {
    WriteAll(seg.fd, header, kHeaderBytes, 0, seg.path);
  } catch (...) {
    ::close(seg.fd);
    ::unlink(seg.path.c_str());
    throw;
  }
  seg.size = kHeaderBytes;
  seg.unsynced = true;
  const uint64_t limit = std::max<uint64_t>(space_->segment_bytes(), kHeaderBytes + seg.rec_bytes);
  RegisterSegment(id, seg, (limit - kHeaderBytes) / seg.rec_bytes);
  active_ = id;
}

void FileRowStore::LeaveActive() {
  if (active_ < 0) return;
  FlushBuffer();
  // Read through SegmentFile from now on (synced, if still needed, by
  // Sync through a new descriptor).
  Segment& seg = segments_[static_cast<uint32_t>(active_)];
  ::close(seg.fd);
  seg.fd = -1;
  active_ = -1;
}

void FileRowStore::RegisterSegment(uint32_t id, Segment seg, uint64_t records) {
  try {
    AddSegment(id, seg, records);
  } catch (...) {
    if (seg.fd >= 0) ::close(seg.fd);
    ::unlink(seg.path.c_str());
    throw;
  }
  file_bytes_ += seg.size;
}

void FileRowStore::FlushBuffer() {
  if (active_ < 0 || buffer_.empty()) return;
  Segment& seg = segments_[static_cast<uint32_t>(active_)];
  // A failed write (disk full) keeps the buffer: nothing is lost in memory
  // and the error names the file.
  WriteAll(seg.fd, buffer_.data(), buffer_.size(), seg.size, seg.path);
  seg.size += buffer_.size();
  seg.unsynced = true;
  buffer_.clear();
}

uint64_t FileRowStore::Append(const float* record) {
  const uint64_t bytes = RecordBytes(static_cast<uint64_t>(width_));
  if (active_ < 0 ||
      segments_[static_cast<uint32_t>(active_)].width != static_cast<uint64_t>(width_) ||
      segments_[static_cast<uint32_t>(active_)].size + buffer_.size() + bytes >
          std::max<uint64_t>(space_->segment_bytes(), kHeaderBytes + bytes)) {
    OpenSegment();
  }
  const Segment& seg = segments_[static_cast<uint32_t>(active_)];
  const uint64_t offset = seg.size + buffer_.size();
  const char* p = reinterpret_cast<const char*>(record);
  const uint64_t value_bytes = static_cast<uint64_t>(width_) * 4;
  const uint32_t crc = RecordCrc(offset, p, value_bytes);
  buffer_.insert(buffer_.end(), p, p + value_bytes);
  buffer_.insert(buffer_.end(), reinterpret_cast<const char*>(&crc),
                 reinterpret_cast<const char*>(&crc) + 4);
  file_bytes_ += bytes;
  live_bytes_ += bytes;
  ++writes_;
  return (static_cast<uint64_t>(active_) << kOffsetBits) | offset;
}

void FileRowStore::UnpackRecord(const Segment& seg, uint64_t offset, const char* src,
                                float* dst) const {
  const uint32_t stored = StoredCrc(src, seg.width);
  const uint32_t computed = RecordCrc(offset, src, seg.width * 4);
  if (stored != computed) throw CorruptRecord(seg.path, offset, stored, computed);
  std::memcpy(dst, src, seg.width * 4);
  // Slots added after the record was written start at their init values.
  for (size_t j = 0; j < widths_.size(); ++j) {
    if (static_cast<uint64_t>(slot_offsets_[j]) >= seg.width) {
      std::fill(dst + slot_offsets_[j], dst + slot_offsets_[j] + widths_[j], inits_[j]);
    }
  }
}

void FileRowStore::ReadRecord(uint64_t loc, float* dst) const {
  const uint32_t id = static_cast<uint32_t>(loc >> kOffsetBits);
  const uint64_t offset = loc & kOffsetMask;
  const auto it = segments_.find(id);
  if (it == segments_.end()) throw std::runtime_error("file-tier row in a missing segment");
  const Segment& seg = it->second;
  if (static_cast<int64_t>(id) == active_ && offset >= seg.size) {
    UnpackRecord(seg, offset, buffer_.data() + (offset - seg.size), dst);
    return;
  }
  const SegmentFile file(*this, id, seg);
  if (seg.rec_bytes <= kStackRecordBytes) {
    char local[kStackRecordBytes];
    ReadRecordBytes(file.fd(), local, seg.rec_bytes, offset, seg.path);
    UnpackRecord(seg, offset, local, dst);
  } else {
    std::vector<char> local(seg.rec_bytes);
    ReadRecordBytes(file.fd(), local.data(), seg.rec_bytes, offset, seg.path);
    UnpackRecord(seg, offset, local.data(), dst);
  }
}

void FileRowStore::Forget(uint64_t loc) {
  if (loc == kNoLocation) return;
  const auto it = segments_.find(static_cast<uint32_t>(loc >> kOffsetBits));
  if (it != segments_.end()) live_bytes_ -= it->second.rec_bytes;
}

void FileRowStore::WriteBack(uint32_t slot) {
  const float* record = cache_.data() + static_cast<uint64_t>(slot) * width_;
  const uint64_t loc = Append(record);
  Forget(cache_loc_[slot]);
  cache_loc_[slot] = loc;
  dirty_[slot] = 0;
  // The row points at its record in the buffer: a failed flush (disk
  // full) keeps both, and the next append retries it.
  if (buffer_.size() >= kBufferBytes) FlushBuffer();
  MaybeCompact();
}

void FileRowStore::MaybeCompact() {
  const uint64_t floor = std::min<uint64_t>(space_->segment_bytes(), kCompactFloorBytes);
  if (compacting_ || file_bytes_ <= 2 * live_bytes_ + floor) return;
  Compact();
}

void FileRowStore::Compact() {
  compacting_ = true;
  try {
    LeaveActive();  // rows go to new segments
    const uint32_t first_new = next_segment_;
    // Every row with a record on file, by location: the old segments are
    // read in order, a chunk at a time. A dirty cached row's record is
    // stale (the row is appended when written back): dropped, not copied.
    std::vector<std::pair<uint64_t, uint32_t>> moves;
    for (uint32_t row = 0; row < next_row_; ++row) {
      const uint64_t loc = Loc(row);
      if (loc == kNoLocation || (loc >> kOffsetBits) >= first_new) continue;
      const int32_t slot = SlotOf(row);
      if (slot >= 0 && dirty_[slot]) {
        Forget(loc);
        cache_loc_[slot] = kNoLocation;
        continue;
      }
      moves.emplace_back(loc, row);
    }
    std::sort(moves.begin(), moves.end());
    std::vector<char> chunk;
    uint64_t chunk_id = kNoLocation, chunk_start = 0;
    std::vector<float> rec(width_);
    for (const auto& [loc, row] : moves) {
      const uint64_t id = loc >> kOffsetBits;
      const uint64_t offset = loc & kOffsetMask;
      const Segment& seg = segments_.at(static_cast<uint32_t>(id));
      if (id != chunk_id || offset < chunk_start ||
          offset + seg.rec_bytes > chunk_start + chunk.size()) {
        // A whole number of records from this one on, at most 4 MiB (and
        // at least the record), never past the segment's end.
        const uint64_t want =
            std::max<uint64_t>(seg.rec_bytes, kChunkBytes / seg.rec_bytes * seg.rec_bytes);
        chunk.resize(std::min<uint64_t>(want, seg.size - offset));
        if (chunk.size() < seg.rec_bytes) {
          throw std::runtime_error("file-tier row past the end of its segment");
        }
        const SegmentFile file(*this, static_cast<uint32_t>(id), seg);
        ReadRecordBytes(file.fd(), chunk.data(), chunk.size(), offset, seg.path);
        chunk_id = id;
        chunk_start = offset;
      }
      UnpackRecord(seg, offset, chunk.data() + (offset - chunk_start), rec.data());
      const uint64_t moved = Append(rec.data());
      if (buffer_.size() >= kBufferBytes) FlushBuffer();
      Forget(loc);
      SetLoc(row, moved);
    }
    FlushBuffer();
    std::vector<uint32_t> old;
    for (const auto& kv : segments_) {
      if (kv.first < first_new) old.push_back(kv.first);
    }
    for (uint32_t id : old) {
      Segment& seg = segments_[id];
      file_bytes_ -= seg.size;
      ::unlink(seg.path.c_str());
      RemoveSegment(id);  // closes its file
    }
    ++compactions_;
  } catch (...) {
    compacting_ = false;  // every row still points at a readable record
    throw;
  }
  compacting_ = false;
}

uint32_t FileRowStore::TakeCacheSlot() {
  if (!free_slots_.empty()) {
    const uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  if (cache_row_.size() < capacity_) {
    if (cache_row_.empty()) {
      // Reserved once (pages are resident only when used): growing by
      // reallocation would copy the cache and hold it twice meanwhile.
      cache_.reserve(capacity_ * static_cast<uint64_t>(width_));
      cache_row_.reserve(capacity_);
      cache_loc_.reserve(capacity_);
      ref_.reserve(capacity_);
      dirty_.reserve(capacity_);
    }
    const uint32_t slot = static_cast<uint32_t>(cache_row_.size());
    cache_.resize(cache_.size() + width_);
    cache_row_.push_back(kNoRow);
    cache_loc_.push_back(kNoLocation);
    ref_.push_back(0);
    dirty_.push_back(0);
    return slot;
  }
  // CLOCK: the first slot whose reference bit is clear, clearing bits on
  // the way (a row touched since the hand last passed gets a second chance).
  while (true) {
    const uint64_t h = hand_;
    hand_ = (hand_ + 1) % cache_row_.size();
    if (ref_[h] & kReferenced) {
      ref_[h] = static_cast<uint8_t>(ref_[h] & ~kReferenced);  // kAhead stays
      continue;
    }
    const uint32_t slot = static_cast<uint32_t>(h);
    if (dirty_[slot]) WriteBack(slot);  // may throw: nothing changed yet
    Uncache(slot);
    return slot;
  }
}

float* FileRowStore::Fetch(uint32_t row, bool write) {
  int32_t slot = SlotOf(row);
  if (slot >= 0) {
    if ((ref_[slot] & kAhead) == 0) ++hits_;  // else Prefetch counted its miss
  } else {
    ++misses_;
    const uint32_t s = TakeCacheSlot();
    // (after TakeCacheSlot: a write-back may compact, moving this row)
    const uint64_t loc = WordToLoc(*where_.Row(row));
    try {
      ReadRecord(loc, cache_.data() + static_cast<uint64_t>(s) * width_);
    } catch (...) {
      free_slots_.push_back(s);
      throw;
    }
    ++reads_;
    slot = static_cast<int32_t>(s);
    Cache(row, s, loc);
    dirty_[s] = 0;
  }
  ref_[slot] = kReferenced;
  if (write) dirty_[slot] = 1;
  return cache_.data() + static_cast<uint64_t>(slot) * width_;
}

void FileRowStore::Prefetch(const uint32_t* rows, size_t n) {
  // Any failure stops here: the rows not loaded are fetched one by one,
  // which raises it where it arose before.
  try {
    // The rows not cached, by record number (a segment's records in file
    // order; segments own disjoint ranges); the cached ones are marked
    // referenced, as their fetch would, so that loading the others passes
    // them over.
    std::vector<uint64_t> want;  // word << 32 | row
    want.reserve(n);
    uint64_t cached = 0;
    constexpr size_t kAheadRows = 8;  // the row words are read at random
    for (size_t i = 0; i < n; ++i) {
      if (i + kAheadRows < n) __builtin_prefetch(where_.Row(rows[i + kAheadRows]));
      const uint32_t w = *where_.Row(rows[i]);
      if (w == kNoWord) continue;
      if (IsCached(w)) {
        ref_[w & ~kCached] |= kReferenced;
        ++cached;
        continue;
      }
      want.push_back(static_cast<uint64_t>(w) << 32 | rows[i]);
    }
    if (want.empty()) return;
    SortByHigh32(&want);  // a row's word is its own: equal words, equal entries
    want.erase(std::unique(want.begin(), want.end()), want.end());
    const uint64_t room = capacity_ > cached ? capacity_ - cached : 0;
    if (want.size() > room) want.resize(static_cast<size_t>(room));
    const uint64_t compactions = compactions_;
    std::vector<char> run;
    size_t i = 0;
    while (i < want.size()) {
      const uint32_t w0 = static_cast<uint32_t>(want[i] >> 32);
      const uint64_t loc0 = WordToLoc(w0);
      const uint32_t id = static_cast<uint32_t>(loc0 >> kOffsetBits);
      const Segment& seg = segments_.at(id);
      const uint64_t start = loc0 & kOffsetMask;
      // The run: records of this segment on file, close to each other.
      uint64_t end = start + seg.rec_bytes;
      size_t j = i + 1;
      if (end <= seg.size) {
        while (j < want.size()) {
          const uint32_t w = static_cast<uint32_t>(want[j] >> 32);
          if (w >= seg.base + seg.cap) break;  // another segment
          const uint64_t at = kHeaderBytes + static_cast<uint64_t>(w - seg.base) * seg.rec_bytes;
          if (at + seg.rec_bytes > seg.size || at > end + kReadGapBytes ||
              at + seg.rec_bytes - start > kReadRunBytes) {
            break;
          }
          end = at + seg.rec_bytes;
          ++j;
        }
        run.resize(static_cast<size_t>(end - start));
        const SegmentFile file(*this, id, seg);
        ReadRecordBytes(file.fd(), run.data(), run.size(), start, seg.path);
      } else {
        run.clear();  // in the active segment's buffer: ReadRecord takes it there
      }
      for (size_t k = i; k < j; ++k) {
        const uint32_t w = static_cast<uint32_t>(want[k] >> 32);
        const uint32_t row = static_cast<uint32_t>(want[k]);
        const uint32_t s = TakeCacheSlot();
        if (compactions_ != compactions) {  // a write-back compacted: rows moved
          free_slots_.push_back(s);
          return;
        }
        float* dst = cache_.data() + static_cast<uint64_t>(s) * width_;
        const uint64_t offset = kHeaderBytes + static_cast<uint64_t>(w - seg.base) * seg.rec_bytes;
        try {
          if (run.empty()) {
            ReadRecord((static_cast<uint64_t>(id) << kOffsetBits) | offset, dst);
          } else {
            UnpackRecord(seg, offset, run.data() + (offset - start), dst);
          }
        } catch (...) {
          free_slots_.push_back(s);
          throw;
        }
        ++misses_;
        ++reads_;
        Cache(row, s, (static_cast<uint64_t>(id) << kOffsetBits) | offset);
        dirty_[s] = 0;
        ref_[s] = kReferenced | kAhead;
      }
      i = j;
    }
  } catch (...) {
  }
}

uint32_t FileRowStore::Allocate(const float* init) {
  bool fresh;
  const uint32_t row = TakeRow(&free_rows_, &next_row_, &fresh);
  uint32_t slot;
  try {
    EnsureRowCapacity(next_row_);
    slot = TakeCacheSlot();
  } catch (...) {
    if (fresh) {
      --next_row_;
    } else {
      free_rows_.push_back(row);
    }
    throw;
  }
  float* rec = cache_.data() + static_cast<uint64_t>(slot) * width_;
  std::copy(init, init + dim_, rec);
  for (size_t j = 0; j < widths_.size(); ++j) {
    std::fill(rec + slot_offsets_[j], rec + slot_offsets_[j] + widths_[j], inits_[j]);
  }
  Cache(row, slot, kNoLocation);
  ref_[slot] = 1;
  dirty_[slot] = 1;
  ++rows_;
  return row;
}

void FileRowStore::Release(uint32_t row) {
  const int32_t slot = SlotOf(row);
  if (slot >= 0) {
    Uncache(static_cast<uint32_t>(slot));
    ref_[slot] = 0;
    dirty_[slot] = 0;
    free_slots_.push_back(static_cast<uint32_t>(slot));
  }
  Forget(WordToLoc(*where_.Row(row)));
  *where_.Row(row) = kNoWord;
  free_rows_.push_back(row);
  --rows_;
}

void FileRowStore::Read(uint32_t row, float* value, float* slots) const {
  std::vector<float> local;
  const float* rec;
  const int32_t slot = SlotOf(row);
  if (slot >= 0) {
    rec = cache_.data() + static_cast<uint64_t>(slot) * width_;
  } else {
    local.resize(width_);
    ReadRecord(WordToLoc(*where_.Row(row)), local.data());
    rec = local.data();
  }
  std::copy(rec, rec + dim_, value);
  std::copy(rec + dim_, rec + width_, slots);
}

void FileRowStore::Sync() {
  for (uint32_t s = 0; s < cache_row_.size(); ++s) {
    if (cache_row_[s] != kNoRow && dirty_[s]) WriteBack(s);
  }
  FlushBuffer();
  for (auto& kv : segments_) {
    Segment& seg = kv.second;
    if (!seg.unsynced) continue;
    if (seg.fd >= 0) {
      if (::fdatasync(seg.fd) != 0) throw IoError("cannot sync the file-tier segment", seg.path);
    } else {
      // A segment left since the last sync (or copied in by a restore).
      const int fd = ::open(seg.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) throw IoError("cannot open the file-tier segment to sync it", seg.path);
      const int rc = ::fdatasync(fd);
      const int err = errno;
      ::close(fd);
      errno = err;
      if (rc != 0) throw IoError("cannot sync the file-tier segment", seg.path);
    }
    seg.unsynced = false;
  }
}

void FileRowStore::Seal() {
  Sync();
  // Every segment is linked into the snapshot: none is written again (a
  // row written back later is appended to a new segment).
  LeaveActive();
}

void FileRowStore::ReserveSlot(int64_t width, float init) {
  // Every row is written out first (may fail: nothing changes); records of
  // the new width go to a new segment.
  Sync();
  LeaveActive();
  pending_width_ = width;
  pending_init_ = init;
  widths_.reserve(widths_.size() + 1);
  inits_.reserve(inits_.size() + 1);
}

void FileRowStore::CommitSlot() {
  // The cache is dropped (every row is clean after ReserveSlot) and comes
  // back at the new width.
  DropCache();
  widths_.push_back(pending_width_);
  inits_.push_back(pending_init_);
  active_ = -1;
  Recompute();
}

void FileRowStore::SetLayout(const std::vector<int64_t>& widths, const std::vector<float>& inits) {
  Clear();
  widths_ = widths;
  inits_ = inits;
  Recompute();
}

void FileRowStore::Clear() {
  for (auto& kv : segments_) {
    if (kv.second.fd >= 0) ::close(kv.second.fd);
    ::unlink(kv.second.path.c_str());
  }
  CloseFiles();
  segments_.clear();
  by_base_.clear();
  free_ranges_.clear();
  free_ranges_[0] = kCached;
  active_ = -1;
  buffer_.clear();
  file_bytes_ = 0;
  live_bytes_ = 0;
  DropCache(/*keep_rows=*/false);
  where_.Clear();
  free_rows_.clear();
  next_row_ = 0;
  rows_ = 0;
}

void FileRowStore::DropCache(bool keep_rows) {
  for (uint32_t slot = 0; keep_rows && slot < cache_row_.size(); ++slot) {
    if (cache_row_[slot] != kNoRow) Uncache(slot);
  }
  cache_.clear();
  cache_.shrink_to_fit();
  cache_row_.clear();
  cache_row_.shrink_to_fit();
  cache_loc_.clear();
  cache_loc_.shrink_to_fit();
  ref_.clear();
  ref_.shrink_to_fit();
  dirty_.clear();
  dirty_.shrink_to_fit();
  free_slots_.clear();
  hand_ = 0;
}

RowStoreStats FileRowStore::Stats() const {
  RowStoreStats s;
  s.rows = rows_;
  s.cached_rows = cache_row_.size() - free_slots_.size();
  // Reserved but unused cache capacity is not resident: counted as used.
  const uint64_t used = cache_row_.size();
  s.memory_bytes = used * (static_cast<uint64_t>(width_) * 4 + 4 + 8 + 2) +
                   where_.BytesAllocated() + free_rows_.capacity() * 4 +
                   free_slots_.capacity() * 4 + buffer_.capacity();
  s.disk_bytes = file_bytes_;
  s.hits = hits_;
  s.misses = misses_;
  s.file_reads = reads_;
  s.file_writes = writes_;
  return s;
}

std::vector<FileRowStore::SegmentInfo> FileRowStore::Segments() const {
  std::vector<SegmentInfo> out;
  for (const auto& kv : segments_) {
    out.push_back(SegmentInfo{kv.first, kv.second.path, kv.second.size, kv.second.width});
  }
  return out;
}

uint32_t FileRowStore::AdoptSegment(const std::string& path, uint64_t width, uint64_t size) {
  Segment seg;
  uint32_t id;
  for (;;) {
    id = next_segment_++;
    seg.path = SegmentPath(id);
    if (::link(path.c_str(), seg.path.c_str()) == 0) break;
    if (errno == EEXIST) continue;  // a name in use: never replace a file
    // On another file system (a snapshot copied to tmpfs or another disk),
    // or one without hard links: a copy of its own, synced by the next
    // snapshot.
    CopySegmentFile(path, seg.path, size);
    seg.unsynced = true;
    break;
  }
  seg.width = width;
  seg.rec_bytes = RecordBytes(width);
  seg.size = size;
  const uint64_t records = size > kHeaderBytes ? (size - kHeaderBytes) / seg.rec_bytes : 0;
  RegisterSegment(id, seg, records);
  return id;
}

uint32_t FileRowStore::AdoptRow(uint64_t location) {
  bool fresh;
  const uint32_t row = TakeRow(&free_rows_, &next_row_, &fresh);
  EnsureRowCapacity(next_row_);
  *where_.Row(row) = LocToWord(location);
  const auto it = segments_.find(static_cast<uint32_t>(location >> kOffsetBits));
  if (it != segments_.end()) live_bytes_ += it->second.rec_bytes;
  ++rows_;
  return row;
}

void VerifySegment(const std::string& path, uint64_t width, uint64_t size, int64_t dim) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open the snapshot segment", path);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) throw IoError("cannot stat the snapshot segment", path);
  const uint64_t rec = SegmentRecordBytes(width);
  if (size < kHeaderBytes || (size - kHeaderBytes) % rec != 0) {
    throw DataLossError("the snapshot segment '" + path + "' is listed with " +
                        std::to_string(size) + " bytes, not a whole number of " +
                        std::to_string(rec) + "-byte records after its header");
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    throw DataLossError("the snapshot segment '" + path +
                        "' is truncated: " + std::to_string(st.st_size) + " bytes on file, " +
                        std::to_string(size) + " written");
  }
  char header[kHeaderBytes];
  ReadRecordBytes(fd, header, kHeaderBytes, 0, path);
  if (std::memcmp(header, kSegmentMagicV1, 8) == 0) {
    throw std::runtime_error("the snapshot segment '" + path +
                             "' was written by an older keras_rec_emb (segment format 01, "
                             "without record checksums); restore it with that version and "
                             "save the model or a checkpoint to carry the rows over");
  }
  uint64_t header_width, header_dim;
  uint32_t header_crc;
  std::memcpy(&header_width, header + 8, 8);
  std::memcpy(&header_dim, header + 16, 8);
  std::memcpy(&header_crc, header + 24, 4);
  if (std::memcmp(header, kSegmentMagic, 8) != 0 || header_crc != Crc32c(0, header, 24)) {
    throw DataLossError("the snapshot segment '" + path +
                        "' has a corrupt header (bad magic or checksum at offset 0)");
  }
  if (header_width != width || header_dim != static_cast<uint64_t>(dim)) {
    throw DataLossError("the snapshot segment '" + path + "' holds records of " +
                        std::to_string(header_width) + " floats (dim " +
                        std::to_string(header_dim) + ") but its index says " +
                        std::to_string(width) + " (dim " + std::to_string(dim) + ")");
  }
  // Every record, in chunks of whole records.
  std::vector<char> chunk;
  const uint64_t per_chunk = std::max<uint64_t>(1, kChunkBytes / rec) * rec;
  for (uint64_t offset = kHeaderBytes; offset < size;) {
    chunk.resize(std::min<uint64_t>(per_chunk, size - offset));
    ReadRecordBytes(fd, chunk.data(), chunk.size(), offset, path);
    for (uint64_t at = 0; at < chunk.size(); at += rec) {
      const uint32_t stored = StoredCrc(chunk.data() + at, width);
      const uint32_t computed = RecordCrc(offset + at, chunk.data() + at, width * 4);
      if (stored != computed) throw CorruptRecord(path, offset + at, stored, computed);
    }
    offset += chunk.size();
  }
}

}  // namespace kv
}  // namespace kre
