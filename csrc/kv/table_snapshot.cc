// Copyright keras_rec_emb authors. Apache-2.0.
// Snapshots of a file-tier table (format and guarantees in file_store.h).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

#include "kv/table.h"

namespace kre {
namespace kv {

namespace {

// Format 02: its segments carry record checksums (file_store.h). Format 01
// snapshots are refused with a message that says so.
constexpr char kIndexMagic[8] = {'K', 'R', 'E', 'S', 'N', 'P', '0', '2'};
constexpr char kIndexMagicV1[8] = {'K', 'R', 'E', 'S', 'N', 'P', '0', '1'};

// CRC-32 (IEEE), incremental: c starts at 0xFFFFFFFF, the CRC is the final
// c ^ 0xFFFFFFFF.
uint32_t Crc32Update(uint32_t c, const uint8_t* p, size_t n) {
  static uint32_t table[256];
  static const bool init = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    return true;
  }();
  (void)init;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

std::runtime_error SnapError(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " '" + path + "'" +
                            (errno ? std::string(": ") + std::strerror(errno) : ""));
}

// Writes the snapshot index to a file through a bounded buffer (a table of
// 100M keys has a 3.2 GB index: it is never held in memory whole), with a
// running CRC-32 of every byte; Finish appends the CRC, fsyncs and closes.
class Writer {
 public:
  explicit Writer(const std::string& path) : path_(path) {
    // A new file in the snapshot's new folder (a link there is refused).
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ < 0) throw SnapError("cannot create", path);
    buf_.reserve(kBufferBytes);
  }
  ~Writer() {
    if (fd_ >= 0) ::close(fd_);
  }
  template <typename T>
  void Put(T v) {
    PutBytes(&v, sizeof(T));
  }
  void PutBytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    while (n > 0) {
      const size_t k = std::min(n, kBufferBytes - buf_.size());
      buf_.insert(buf_.end(), b, b + k);
      b += k;
      n -= k;
      if (buf_.size() == kBufferBytes) Flush();
    }
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    PutBytes(s.data(), s.size());
  }
  void Finish() {
    Flush();
    const uint32_t crc = crc_ ^ 0xFFFFFFFFu;
    buf_.insert(buf_.end(), reinterpret_cast<const uint8_t*>(&crc),
                reinterpret_cast<const uint8_t*>(&crc) + 4);
    Write();
    const int rc = ::fsync(fd_);
    const int fd = fd_;
    fd_ = -1;
    if (rc != 0) {
      ::close(fd);
      throw SnapError("cannot fsync", path_);
    }
    if (::close(fd) != 0) throw SnapError("cannot close", path_);
  }

 private:
  static constexpr size_t kBufferBytes = 4 << 20;
  void Flush() {
    crc_ = Crc32Update(crc_, buf_.data(), buf_.size());
    Write();
  }
  void Write() {
    size_t done = 0;
    while (done < buf_.size()) {
      const ssize_t w = ::write(fd_, buf_.data() + done, buf_.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throw SnapError("cannot write", path_);
      done += static_cast<size_t>(w);
    }
    buf_.clear();
  }
  std::string path_;
  int fd_ = -1;
  std::vector<uint8_t> buf_;
  uint32_t crc_ = 0xFFFFFFFFu;
};

// Reads a snapshot index written by Writer through a bounded buffer: the
// body (all but the last 4 bytes) with a running CRC-32; Finish reads the
// rest of the body and checks the stored CRC. Reading past the body throws
// ("truncated or corrupt").
class Reader {
 public:
  explicit Reader(const std::string& path, bool crc = true) : path_(path), check_crc_(crc) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw SnapError("cannot open", path);
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw SnapError("cannot stat", path);
    size_ = static_cast<uint64_t>(st.st_size);
    body_ = size_ >= 4 ? size_ - 4 : 0;
  }
  ~Reader() {
    if (fd_ >= 0) ::close(fd_);
  }
  uint64_t size() const { return size_; }
  template <typename T>
  T Get() {
    T v;
    GetBytes(&v, sizeof(T));
    return v;
  }
  void GetBytes(void* p, size_t n) {
    auto* out = static_cast<uint8_t*>(p);
    while (n > 0) {
      if (pos_ == buf_.size()) Fill();
      const size_t k = std::min(n, buf_.size() - pos_);
      std::memcpy(out, buf_.data() + pos_, k);
      out += k;
      pos_ += k;
      n -= k;
    }
  }
  std::string GetString() {
    const uint64_t n = Get<uint64_t>();
    if (n > body_) Corrupt();
    std::string s(n, '\0');
    GetBytes(s.data(), n);
    return s;
  }
  // Bytes of the body left to read.
  uint64_t Remaining() const { return body_ - read_ + (buf_.size() - pos_); }
  void Finish() {
    while (read_ < body_) {
      pos_ = buf_.size();
      Fill();
    }
    uint32_t stored;
    if (!ReadAt(reinterpret_cast<uint8_t*>(&stored), 4, body_)) Corrupt();
    if ((crc_ ^ 0xFFFFFFFFu) != stored) {
      errno = 0;
      throw SnapError("the snapshot index is corrupt (CRC mismatch)", path_);
    }
  }
  [[noreturn]] void Corrupt() const {
    errno = 0;
    throw SnapError("the snapshot index is truncated or corrupt", path_);
  }

 private:
  static constexpr size_t kBufferBytes = 4 << 20;
  void Fill() {
    if (read_ >= body_) Corrupt();
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kBufferBytes, body_ - read_));
    buf_.resize(n);
    if (!ReadAt(buf_.data(), n, read_)) Corrupt();
    if (check_crc_) crc_ = Crc32Update(crc_, buf_.data(), n);
    read_ += n;
    pos_ = 0;
  }
  bool ReadAt(uint8_t* p, size_t n, uint64_t offset) {
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw SnapError("cannot read", path_);
      if (r == 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
    return true;
  }
  std::string path_;
  bool check_crc_;
  int fd_ = -1;
  uint64_t size_ = 0, body_ = 0, read_ = 0;
  std::vector<uint8_t> buf_;
  size_t pos_ = 0;
  uint32_t crc_ = 0xFFFFFFFFu;
};

void SyncPath(const std::string& path, bool dir) {
  const int fd = ::open(path.c_str(), (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw SnapError("cannot open for fsync", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw SnapError("cannot fsync", path);
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& data) {
  // A file left there (or a link planted in its place) is unlinked, not
  // truncated: a link would make the write change the file it points to.
  ::unlink(path.c_str());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) throw SnapError("cannot create", path);
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      ::close(fd);
      throw SnapError("cannot write", path);
    }
    done += static_cast<size_t>(w);
  }
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw SnapError("cannot fsync", path);
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw SnapError("cannot open", path);
  std::vector<uint8_t> data;
  uint8_t chunk[1 << 16];
  while (true) {
    const ssize_t r = ::read(fd, chunk, sizeof(chunk));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      ::close(fd);
      throw SnapError("cannot read", path);
    }
    if (r == 0) break;
    data.insert(data.end(), chunk, chunk + r);
  }
  ::close(fd);
  return data;
}

// The snapshot names under root ("snap-<seq>"), sequence numbers ascending.
std::vector<int64_t> SnapshotSeqs(const std::string& root, bool tmp) {
  std::vector<int64_t> seqs;
  if (DIR* d = ::opendir(root.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind("snap-", 0) != 0) continue;
      const bool is_tmp = name.size() > 4 && name.substr(name.size() - 4) == ".tmp";
      if (is_tmp != tmp) continue;
      seqs.push_back(std::atoll(name.c_str() + 5));
    }
    ::closedir(d);
  }
  std::sort(seqs.begin(), seqs.end());
  return seqs;
}

std::string SnapName(int64_t seq) { return "snap-" + std::to_string(seq); }

}  // namespace

template <typename K>
void Table<K>::ReleaseStorageLock() {
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  storage_lock_.reset();
}

template <typename K>
int64_t Table<K>::Snapshot() {
  if (!file_tier()) throw std::invalid_argument("Snapshot needs a file-tier table");
  if (!storage_lock_) {
    throw std::runtime_error("the table has released storage_path '" + options_.storage_path +
                             "'; snapshots need its lock");
  }
  const std::string root = options_.storage_path;
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  std::lock_guard<std::mutex> specs_lock(slot_specs_mu_);
  for (const int64_t seq : SnapshotSeqs(root, /*tmp=*/true)) {
    RemoveTree(root + "/" + SnapName(seq) + ".tmp");  // a killed snapshot's leftovers
  }
  // The next number follows the committed one (CURRENT); a snapshot folder
  // past it is one a killed process renamed but never committed: removed.
  int64_t committed = 0;
  {
    const int fd = ::open((root + "/CURRENT").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      char text[64] = {};
      const ssize_t r = ::read(fd, text, sizeof(text) - 1);
      ::close(fd);
      if (r > 5 && std::strncmp(text, "snap-", 5) == 0) committed = std::atoll(text + 5);
    }
  }
  std::vector<int64_t> done;
  for (const int64_t old : SnapshotSeqs(root, false)) {
    if (old > committed) {
      RemoveTree(root + "/" + SnapName(old));
    } else {
      done.push_back(old);
    }
  }
  const int64_t seq = committed + 1;
  const std::string tmp = root + "/" + SnapName(seq) + ".tmp";
  if (::mkdir(tmp.c_str(), 0755) != 0) throw SnapError("cannot create", tmp);
  // The index streams to its file while the shards are written out.
  Writer w(tmp + "/index");
  w.PutBytes(kIndexMagic, 8);
  w.Put<uint64_t>(sizeof(K));
  w.Put<int64_t>(dim_);
  w.Put<uint64_t>(shards_.size());
  w.Put<int64_t>(LatestStep());
  w.Put<uint64_t>(slot_specs_.size());
  for (const auto& spec : slot_specs_) {
    w.PutString(spec.name);
    w.Put<int64_t>(spec.width);
    w.Put<float>(spec.init);
  }
  w.Put<uint64_t>(default_values_.size());
  w.PutBytes(default_values_.data(), default_values_.size() * sizeof(float));
  // Streamed: a filter sized for 2**30 keys is tens of GiB, mostly pages
  // never written.
  w.Put<uint64_t>(bloom_.StateBytes());
  bloom_.VisitState([&](const uint8_t* p, size_t n) { w.PutBytes(p, n); });
  for (size_t si = 0; si < shards_.size(); ++si) {
    Shard& s = *shards_[si];
    auto* store = static_cast<FileRowStore*>(s.store.get());
    store->Seal();  // dirty rows written, flushed, fsynced; segments immutable
    const auto segments = store->Segments();
    w.Put<uint64_t>(segments.size());
    for (const auto& seg : segments) {
      const std::string name = "s" + std::to_string(si) + "-" + std::to_string(seg.id) + ".seg";
      if (::link(seg.path.c_str(), (tmp + "/" + name).c_str()) != 0) {
        throw SnapError("cannot hard-link the segment into the snapshot", seg.path);
      }
      w.Put<uint32_t>(seg.id);
      w.Put<uint64_t>(seg.size);
      w.Put<uint64_t>(seg.width);
    }
    w.Put<uint64_t>(s.index.live());
    for (uint64_t i = 0; i < s.index.capacity(); ++i) {
      if (!s.index.Occupied(i)) continue;
      const Entry& e = s.index.entry(i);
      const int64_t* m = Meta(s, e);
      w.Put<int64_t>(static_cast<int64_t>(e.key));
      w.Put<uint64_t>(e.row == kNoRow ? kNoLocation : store->Location(e.row));
      w.Put<int64_t>(m ? m[kFreq] : 0);
      w.Put<int64_t>(m ? m[kVersion] : 0);
    }
  }
  w.Finish();
  SyncPath(tmp, true);
  const std::string final_dir = root + "/" + SnapName(seq);
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) throw SnapError("cannot rename", tmp);
  SyncPath(root, true);
  const std::string name = SnapName(seq) + "\n";
  WriteFile(root + "/CURRENT.tmp", std::vector<uint8_t>(name.begin(), name.end()));
  if (::rename((root + "/CURRENT.tmp").c_str(), (root + "/CURRENT").c_str()) != 0) {
    throw SnapError("cannot rename", root + "/CURRENT.tmp");
  }
  SyncPath(root, true);
  // Keep this snapshot and the one before it.
  for (const int64_t old : done) {
    if (old < seq - 1) RemoveTree(root + "/" + SnapName(old));
  }
  return seq;
}

template <typename K>
int64_t Table<K>::RestoreSnapshot(const std::string& path) {
  if (!file_tier()) throw std::invalid_argument("RestoreSnapshot needs a file-tier table");
  const std::string root = path.empty() ? options_.storage_path : path;
  errno = 0;
  std::vector<uint8_t> current = ReadFile(root + "/CURRENT");
  std::string name(current.begin(), current.end());
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (name.rfind("snap-", 0) != 0 || name.find('/') != std::string::npos) {
    errno = 0;
    throw SnapError("CURRENT does not name a snapshot", root + "/CURRENT");
  }
  const std::string dir = root + "/" + name;
  const std::string index_path = dir + "/index";
  // The index is read twice, streaming (never whole in memory): a first
  // pass checks everything (structure, segments, locations, CRC) without
  // changing the table, the second fills the table.
  struct SegRef {
    uint32_t id;
    uint64_t size, width;
    std::string path;
  };
  int64_t latest = -1;
  std::vector<SlotSpec> specs;
  std::vector<float> defaults;
  // The snapshot's Bloom counters, loaded (in the filling pass) into a
  // filter of their own, swapped in with the rest.
  std::unique_ptr<CountingBloomFilter> staged_bloom;
  std::vector<std::vector<SegRef>> segs(shards_.size());
  std::vector<std::unordered_map<uint32_t, size_t>> seg_pos(shards_.size());
  int64_t width = dim_;
  auto read_header = [&](Reader& r, bool load_bloom) {
    errno = 0;
    char magic[8];
    if (r.size() < 12) throw SnapError("not a snapshot index (bad magic or truncated)", index_path);
    r.GetBytes(magic, 8);
    if (std::memcmp(magic, kIndexMagicV1, 8) == 0) {
      throw SnapError(
          "the snapshot was written by an older keras_rec_emb (format 01, without record "
          "checksums); restore it with that version and save the model or a checkpoint to "
          "carry the rows over",
          index_path);
    }
    if (std::memcmp(magic, kIndexMagic, 8) != 0) {
      throw SnapError("not a snapshot index (bad magic or truncated)", index_path);
    }
    if (r.Get<uint64_t>() != sizeof(K) || r.Get<int64_t>() != dim_ ||
        r.Get<uint64_t>() != shards_.size()) {
      throw SnapError("the snapshot has another key type, dim or shard count than this table",
                      index_path);
    }
    latest = r.Get<int64_t>();
    const uint64_t nspecs = r.Get<uint64_t>();
    if (nspecs > r.Remaining()) r.Corrupt();
    specs.assign(nspecs, SlotSpec{});
    for (auto& spec : specs) {
      spec.name = r.GetString();
      spec.width = r.Get<int64_t>();
      spec.init = r.Get<float>();
    }
    const uint64_t ndefaults = r.Get<uint64_t>();
    if (ndefaults > r.Remaining() / sizeof(float)) r.Corrupt();
    defaults.assign(ndefaults, 0.0f);
    r.GetBytes(defaults.data(), defaults.size() * sizeof(float));
    const uint64_t nbloom = r.Get<uint64_t>();
    if (nbloom > r.Remaining()) r.Corrupt();
    if (defaults.empty() || defaults.size() % dim_ != 0 ||
        (nbloom != 0 && nbloom != bloom_.StateBytes())) {
      throw SnapError("the snapshot's initializer or Bloom filter does not fit this table",
                      index_path);
    }
    // Read in chunks, never whole: a filter may be tens of GiB, mostly
    // zeros, which the staged filter leaves unallocated.
    std::vector<uint8_t> chunk(static_cast<size_t>(std::min<uint64_t>(nbloom, 1 << 20)));
    if (load_bloom && nbloom != 0) {
      staged_bloom = std::make_unique<CountingBloomFilter>(
          options_.bloom_counters, options_.bloom_hashes, options_.bloom_counter_bytes);
    }
    bool marker = true;
    for (uint64_t at = 0; at < nbloom;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), nbloom - at));
      r.GetBytes(chunk.data(), n);
      if (staged_bloom) marker = staged_bloom->LoadStatePiece(at, chunk.data(), n) && marker;
      at += n;
    }
    // Counters of an earlier layout (another marker) are not restored.
    if (!marker) staged_bloom.reset();
    width = dim_;
    for (const auto& spec : specs) width += spec.width;
  };
  auto read_segments = [&](Reader& r, size_t si) {
    const uint64_t nsegs = r.Get<uint64_t>();
    if (nsegs > r.Remaining() / 20) r.Corrupt();
    segs[si].assign(nsegs, SegRef{});
    seg_pos[si].clear();
    for (size_t g = 0; g < segs[si].size(); ++g) {
      SegRef& seg = segs[si][g];
      seg.id = r.Get<uint32_t>();
      seg.size = r.Get<uint64_t>();
      seg.width = r.Get<uint64_t>();
      seg.path = dir + "/s" + std::to_string(si) + "-" + std::to_string(seg.id) + ".seg";
      seg_pos[si][seg.id] = g;
    }
  };
  constexpr uint64_t kRowBytes = 32;  // key, location, frequency, version
  {
    Reader r(index_path);
    try {
      read_header(r, /*load_bloom=*/false);
      for (size_t si = 0; si < shards_.size(); ++si) {
        read_segments(r, si);
        for (const auto& seg : segs[si]) {
          struct stat st;
          if (::stat(seg.path.c_str(), &st) != 0) {
            throw SnapError("missing snapshot segment", seg.path);
          }
          errno = 0;
          if (static_cast<uint64_t>(st.st_size) < seg.size ||
              seg.width < static_cast<uint64_t>(dim_) || seg.width > static_cast<uint64_t>(width)) {
            throw SnapError("the snapshot segment is truncated or does not fit", seg.path);
          }
          // Header and every record's checksum (names the file and offset).
          VerifySegment(seg.path, seg.width, seg.size, dim_);
        }
        const uint64_t n = r.Get<uint64_t>();
        if (n > r.Remaining() / kRowBytes) r.Corrupt();
        for (uint64_t k = 0; k < n; ++k) {
          r.Get<int64_t>();  // key
          const uint64_t loc = r.Get<uint64_t>();
          r.Get<int64_t>();  // frequency
          r.Get<int64_t>();  // version
          if (loc == kNoLocation) continue;
          const uint32_t id = static_cast<uint32_t>(loc >> 40);
          const uint64_t off = loc & ((uint64_t{1} << 40) - 1);
          const auto it = seg_pos[si].find(id);
          const uint64_t rec =
              it == seg_pos[si].end() ? 1 : SegmentRecordBytes(segs[si][it->second].width);
          if (it == seg_pos[si].end() || off < kSegmentHeaderBytes ||
              (off - kSegmentHeaderBytes) % rec != 0 || off + rec > segs[si][it->second].size) {
            errno = 0;
            throw SnapError("the snapshot index points outside its segments", index_path);
          }
        }
      }
    } catch (const std::runtime_error&) {
      r.Finish();  // a CRC mismatch is the better explanation
      throw;
    }
    r.Finish();  // the CRC of the whole index
  }
  // Everything checked. The new contents are built aside, in new shards
  // (index, metadata, and a store with the snapshot's segments linked, or
  // copied from another file system, into the table's directory), and
  // swapped in once every shard is complete: a failure on the way (a full
  // disk, memory) leaves the table as it was and removes the files it had
  // added. The old and the new index and metadata are both in memory
  // meanwhile.
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  LockAll(&locks);
  std::lock_guard<std::mutex> specs_lock(slot_specs_mu_);
  std::vector<int64_t> widths;
  std::vector<float> inits;
  for (const auto& spec : specs) {
    widths.push_back(spec.width);
    inits.push_back(spec.init);
  }
  int64_t keys = 0;
  auto fill = [&](Reader& r, size_t si, Shard& s) {
    auto* store = static_cast<FileRowStore*>(s.store.get());
    // Its files are named apart from the live store's.
    store->NumberAfter(*static_cast<const FileRowStore*>(shards_[si]->store.get()));
    store->SetLayout(widths, inits);
    read_segments(r, si);
    std::unordered_map<uint32_t, uint32_t> ids;  // snapshot id -> new id
    for (const auto& seg : segs[si]) {
      ids[seg.id] = store->AdoptSegment(seg.path, seg.width, seg.size);
    }
    const uint64_t n = r.Get<uint64_t>();
    for (uint64_t k = 0; k < n; ++k) {
      const K key = static_cast<K>(r.Get<int64_t>());
      const uint64_t loc = r.Get<uint64_t>();
      const int64_t freq = r.Get<int64_t>();
      const int64_t version = r.Get<int64_t>();
      const uint64_t h = Hash(key);
      s.index.Reserve(IndexMaxLoad());
      const uint32_t aux = NewAux(s);
      if (options_.track_meta) {
        int64_t* m = s.meta.Row(aux);
        m[kFreq] = freq;
        m[kVersion] = version;
      }
      uint32_t value_row = kNoRow;
      if (loc == kNoLocation) {
        ++s.filtered;
      } else {
        const uint64_t new_id = ids.at(static_cast<uint32_t>(loc >> 40));
        value_row = store->AdoptRow((new_id << 40) | (loc & ((uint64_t{1} << 40) - 1)));
      }
      s.index.Insert(key, h, Entry{key, value_row, aux});
      ++keys;
    }
  };
  std::vector<std::unique_ptr<Shard>> fresh;
  try {
    Reader r(index_path, /*crc=*/false);
    read_header(r, /*load_bloom=*/true);
    fresh.reserve(shards_.size());
    for (size_t si = 0; si < shards_.size(); ++si) {
      fresh.push_back(std::make_unique<Shard>());
      fresh.back()->store = NewStore(static_cast<int>(si));
      fill(r, si, *fresh.back());
    }
  } catch (...) {
    for (auto& s : fresh) {
      if (s->store) s->store->Clear();  // removes the files it added
    }
    throw;
  }
  for (size_t si = 0; si < shards_.size(); ++si) {
    shards_[si]->SwapContents(*fresh[si]);
    fresh[si]->store->Clear();  // the replaced rows' files
  }
  slot_specs_.swap(specs);
  default_values_.swap(defaults);
  default_value_dim_ = static_cast<int64_t>(default_values_.size()) / dim_;
  if (staged_bloom) bloom_.SwapCounters(*staged_bloom);
  reset_epoch_ = ChangeEpoch();  // contents replaced wholesale: no delta spans this
  RaiseLatestStep(latest);
  return keys;
}

template void Table<int64_t>::ReleaseStorageLock();
template void Table<int32_t>::ReleaseStorageLock();
template int64_t Table<int64_t>::Snapshot();
template int64_t Table<int32_t>::Snapshot();
template int64_t Table<int64_t>::RestoreSnapshot(const std::string&);
template int64_t Table<int32_t>::RestoreSnapshot(const std::string&);

}  // namespace kv
}  // namespace kre
