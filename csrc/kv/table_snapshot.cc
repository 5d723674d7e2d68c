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

#include "kv/table.h"

namespace kre {
namespace kv {

namespace {

constexpr char kIndexMagic[8] = {'K', 'R', 'E', 'S', 'N', 'P', '0', '1'};

uint32_t Crc32(const uint8_t* p, size_t n) {
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
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::runtime_error SnapError(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " '" + path + "'" +
                            (errno ? std::string(": ") + std::strerror(errno) : ""));
}

class Writer {
 public:
  template <typename T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf.insert(buf.end(), p, p + sizeof(T));
  }
  void PutBytes(const void* p, size_t n) {
    if (n == 0) return;
    const auto* b = static_cast<const uint8_t*>(p);
    buf.insert(buf.end(), b, b + n);
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    PutBytes(s.data(), s.size());
  }
  std::vector<uint8_t> buf;
};

class Reader {
 public:
  Reader(const std::vector<uint8_t>& b, const std::string& path) : buf(b), path(path) {}
  template <typename T>
  T Get() {
    T v;
    Need(sizeof(T));
    std::memcpy(&v, buf.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  void GetBytes(void* p, size_t n) {
    Need(n);
    if (n == 0) return;
    std::memcpy(p, buf.data() + pos, n);
    pos += n;
  }
  std::string GetString() {
    const uint64_t n = Get<uint64_t>();
    Need(n);
    std::string s(reinterpret_cast<const char*>(buf.data() + pos), n);
    pos += n;
    return s;
  }
  void Need(uint64_t n) {
    if (n > buf.size() - pos) {
      errno = 0;
      throw SnapError("the snapshot index is truncated or corrupt", path);
    }
  }
  const std::vector<uint8_t>& buf;
  std::string path;
  size_t pos = 0;
};

void SyncPath(const std::string& path, bool dir) {
  const int fd = ::open(path.c_str(), (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw SnapError("cannot open for fsync", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw SnapError("cannot fsync", path);
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
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

void RemoveDir(const std::string& path) {
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") ::unlink((path + "/" + name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(path.c_str());
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
    RemoveDir(root + "/" + SnapName(seq) + ".tmp");  // a killed snapshot's leftovers
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
      RemoveDir(root + "/" + SnapName(old));
    } else {
      done.push_back(old);
    }
  }
  const int64_t seq = committed + 1;
  const std::string tmp = root + "/" + SnapName(seq) + ".tmp";
  if (::mkdir(tmp.c_str(), 0755) != 0) throw SnapError("cannot create", tmp);
  Writer w;
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
  const std::vector<uint8_t> bloom = bloom_.State();
  w.Put<uint64_t>(bloom.size());
  w.PutBytes(bloom.data(), bloom.size());
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
  w.Put<uint32_t>(Crc32(w.buf.data(), w.buf.size()));
  WriteFile(tmp + "/index", w.buf);
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
    if (old < seq - 1) RemoveDir(root + "/" + SnapName(old));
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
  const std::vector<uint8_t> data = ReadFile(index_path);
  errno = 0;
  if (data.size() < 12 || std::memcmp(data.data(), kIndexMagic, 8) != 0) {
    throw SnapError("not a snapshot index (bad magic or truncated)", index_path);
  }
  uint32_t crc;
  std::memcpy(&crc, data.data() + data.size() - 4, 4);
  if (Crc32(data.data(), data.size() - 4) != crc) {
    throw SnapError("the snapshot index is corrupt (CRC mismatch)", index_path);
  }
  const std::vector<uint8_t> body(data.begin(), data.end() - 4);
  Reader r(body, index_path);
  char magic[8];
  r.GetBytes(magic, 8);
  if (r.Get<uint64_t>() != sizeof(K) || r.Get<int64_t>() != dim_ ||
      r.Get<uint64_t>() != shards_.size()) {
    throw SnapError("the snapshot has another key type, dim or shard count than this table",
                    index_path);
  }
  const int64_t latest = r.Get<int64_t>();
  std::vector<SlotSpec> specs(r.Get<uint64_t>());
  for (auto& spec : specs) {
    spec.name = r.GetString();
    spec.width = r.Get<int64_t>();
    spec.init = r.Get<float>();
  }
  std::vector<float> defaults(r.Get<uint64_t>());
  r.GetBytes(defaults.data(), defaults.size() * sizeof(float));
  std::vector<uint8_t> bloom(r.Get<uint64_t>());
  r.GetBytes(bloom.data(), bloom.size());
  if (defaults.empty() || defaults.size() % dim_ != 0 ||
      (!bloom.empty() && bloom.size() != bloom_.StateBytes())) {
    throw SnapError("the snapshot's initializer or Bloom filter does not fit this table",
                    index_path);
  }
  struct SegRef { uint32_t id; uint64_t size, width; std::string path; };
  struct Row { int64_t key; uint64_t loc; int64_t freq, version; };
  std::vector<std::vector<SegRef>> segs(shards_.size());
  std::vector<std::vector<Row>> rows(shards_.size());
  int64_t width = dim_;
  for (const auto& spec : specs) width += spec.width;
  for (size_t si = 0; si < shards_.size(); ++si) {
    segs[si].resize(r.Get<uint64_t>());
    for (auto& seg : segs[si]) {
      seg.id = r.Get<uint32_t>();
      seg.size = r.Get<uint64_t>();
      seg.width = r.Get<uint64_t>();
      seg.path = dir + "/s" + std::to_string(si) + "-" + std::to_string(seg.id) + ".seg";
      struct stat st;
      if (::stat(seg.path.c_str(), &st) != 0) throw SnapError("missing snapshot segment", seg.path);
      errno = 0;
      if (static_cast<uint64_t>(st.st_size) < seg.size || seg.width < static_cast<uint64_t>(dim_) ||
          seg.width > static_cast<uint64_t>(width)) {
        throw SnapError("the snapshot segment is truncated or does not fit", seg.path);
      }
    }
    rows[si].resize(r.Get<uint64_t>());
    for (auto& row : rows[si]) {
      row.key = r.Get<int64_t>();
      row.loc = r.Get<uint64_t>();
      row.freq = r.Get<int64_t>();
      row.version = r.Get<int64_t>();
      if (row.loc == kNoLocation) continue;
      const uint32_t id = static_cast<uint32_t>(row.loc >> 40);
      const uint64_t off = row.loc & ((uint64_t{1} << 40) - 1);
      const auto it = std::find_if(segs[si].begin(), segs[si].end(),
                                   [&](const SegRef& g) { return g.id == id; });
      if (it == segs[si].end() || off < 32 || off + it->width * 4 > it->size) {
        throw SnapError("the snapshot index points outside its segments", index_path);
      }
    }
  }
  // Everything checked: replace the contents.
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
  for (size_t si = 0; si < shards_.size(); ++si) {
    Shard& s = *shards_[si];
    auto* store = static_cast<FileRowStore*>(s.store.get());
    s.Reset();
    store->SetLayout(widths, inits);
    std::vector<std::pair<uint32_t, uint32_t>> ids;  // snapshot id -> new id
    for (const auto& seg : segs[si]) {
      ids.emplace_back(seg.id, store->AdoptSegment(seg.path, seg.width, seg.size));
    }
    for (const Row& row : rows[si]) {
      const K key = static_cast<K>(row.key);
      const uint64_t h = Hash(key);
      s.index.Reserve();
      const uint32_t aux = NewAux(s);
      if (options_.track_meta) {
        int64_t* m = s.meta.Row(aux);
        m[kFreq] = row.freq;
        m[kVersion] = row.version;
      }
      uint32_t value_row = kNoRow;
      if (row.loc == kNoLocation) {
        ++s.filtered;
      } else {
        const uint32_t old_id = static_cast<uint32_t>(row.loc >> 40);
        uint32_t new_id = 0;
        for (const auto& p : ids) {
          if (p.first == old_id) new_id = p.second;
        }
        value_row = store->AdoptRow((static_cast<uint64_t>(new_id) << 40) |
                                    (row.loc & ((uint64_t{1} << 40) - 1)));
      }
      s.index.Insert(key, h, Entry{key, value_row, aux});
      ++keys;
    }
  }
  slot_specs_ = specs;
  default_values_ = defaults;
  default_value_dim_ = static_cast<int64_t>(defaults.size()) / dim_;
  if (!bloom.empty()) bloom_.SetState(bloom);
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
