// Copyright keras_rec_emb authors. Apache-2.0.
#include "kv/bloom_filter.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

#include "kv/hash.h"

namespace kre {
namespace kv {

void BloomSizing(uint64_t n, double p, uint64_t* counters, int* hashes) {
  const double ln2 = std::log(2.0);
  const double m = std::ceil(-static_cast<double>(n) * std::log(p) / (ln2 * ln2));
  *counters = static_cast<uint64_t>(std::max(1.0, m));
  *hashes = std::max(1, static_cast<int>(std::lround(m / static_cast<double>(n) * ln2)));
}

namespace {

// Counters read and incremented atomically (relaxed: a counter is an
// estimate; shards that share one race only on the count, which the
// compare-exchange keeps exact).
template <typename C>
uint64_t LoadCounter(const uint8_t* base, uint64_t i) {
  return __atomic_load_n(reinterpret_cast<const C*>(base) + i, __ATOMIC_RELAXED);
}

template <typename C>
void IncrementCounter(uint8_t* base, uint64_t i) {
  C* c = reinterpret_cast<C*>(base) + i;
  C v = __atomic_load_n(c, __ATOMIC_RELAXED);
  while (v != static_cast<C>(~C{0}) &&  // saturated counters stay
         !__atomic_compare_exchange_n(c, &v, static_cast<C>(v + 1), /*weak=*/true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
}

// fn(C{}) for the counter type C of `bytes` bytes (1, 2, 4, else 8).
template <typename Fn>
auto WithCounterType(int bytes, Fn&& fn) {
  switch (bytes) {
    case 1:
      return fn(uint8_t{});
    case 2:
      return fn(uint16_t{});
    case 4:
      return fn(uint32_t{});
    default:
      return fn(uint64_t{});
  }
}

uint64_t GetCounter(const uint8_t* base, uint64_t i, int bytes) {
  return WithCounterType(bytes, [&](auto c) { return LoadCounter<decltype(c)>(base, i); });
}

void BumpCounter(uint8_t* base, uint64_t i, int bytes) {
  WithCounterType(bytes, [&](auto c) { IncrementCounter<decltype(c)>(base, i); });
}

// Appended to the saved counters: tells this layout (one filter for the
// table) from the per-shard layout of earlier versions, which cannot be
// mapped to it and is not restored.
constexpr char kBloomMagic[8] = {'K', 'R', 'E', 'C', 'B', 'F', '2', '\0'};

}  // namespace

CountingBloomFilter::CountingBloomFilter(uint64_t counters, int hashes, int counter_bytes)
    : counters_(counters), hashes_(hashes), bytes_(counter_bytes) {
  if (counters_ == 0) return;
  if (bytes_ != 1 && bytes_ != 2 && bytes_ != 4 && bytes_ != 8) {
    throw std::invalid_argument("bloom_counter_bytes must be 1, 2, 4 or 8");
  }
  if (hashes_ < 1) throw std::invalid_argument("bloom_hashes must be >= 1");
  if (counters_ > (uint64_t{1} << 61)) throw std::bad_alloc();
  const long page = ::sysconf(_SC_PAGESIZE);
  if (page > 0 && (page & (page - 1)) == 0) page_ = static_cast<size_t>(page);
  page_shift_ = 0;
  while ((size_t{1} << page_shift_) < page_) ++page_shift_;
  size_ = static_cast<size_t>(counters_) * static_cast<size_t>(bytes_);
  pages_ = (size_ + page_ - 1) >> page_shift_;
  data_bytes_ = static_cast<size_t>(pages_) << page_shift_;
  const size_t bitmap_bytes = ((pages_ + 63) / 64) * 8;
  mapped_bytes_ = data_bytes_ + ((bitmap_bytes + page_ - 1) & ~(page_ - 1));
  // Reserved, not committed: pages are zero-filled on their first write
  // (never a memset of the whole filter). Huge pages are refused: with
  // transparent huge pages a key's first sighting would commit 2 MiB.
  void* p = ::mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_NOHUGEPAGE
  ::madvise(p, mapped_bytes_, MADV_NOHUGEPAGE);
#endif
  data_ = static_cast<uint8_t*>(p);
  written_ = reinterpret_cast<uint64_t*>(data_ + data_bytes_);
}

CountingBloomFilter::~CountingBloomFilter() {
  if (data_ != nullptr) ::munmap(data_, mapped_bytes_);
}

void CountingBloomFilter::MarkPage(uint64_t i) {
  const uint64_t page = (i * static_cast<uint64_t>(bytes_)) >> page_shift_;
  uint64_t* word = written_ + (page >> 6);
  const uint64_t bit = uint64_t{1} << (page & 63);
  if ((__atomic_load_n(word, __ATOMIC_RELAXED) & bit) == 0 &&
      (__atomic_fetch_or(word, bit, __ATOMIC_RELAXED) & bit) == 0) {
    __atomic_fetch_add(&written_pages_, 1, __ATOMIC_RELAXED);
  }
}

bool CountingBloomFilter::PageWritten(uint64_t page) const {
  return (__atomic_load_n(written_ + (page >> 6), __ATOMIC_RELAXED) >> (page & 63)) & 1;
}

uint64_t CountingBloomFilter::MemoryBytes() const {
  if (!enabled()) return 0;
  return __atomic_load_n(&written_pages_, __ATOMIC_RELAXED) * page_ + (mapped_bytes_ - data_bytes_);
}

void CountingBloomFilter::SwapCounters(CountingBloomFilter& o) {
  std::swap(data_, o.data_);
  std::swap(written_, o.written_);
  std::swap(written_pages_, o.written_pages_);
  std::swap(mapped_bytes_, o.mapped_bytes_);
  std::swap(data_bytes_, o.data_bytes_);
}

uint64_t CountingBloomFilter::Slot(uint64_t h, int k) const {
  // Double hashing over two re-mixed hashes (h's own middle bits select the
  // shard), reduced to the filter's range by a multiply. The filter is one
  // for the table: a key's k positions range over all m counters whatever
  // the shard count, so the false-positive rate is the one it was sized
  // for.
  const uint64_t base = HashKey(h ^ 0x9e3779b97f4a7c15ULL);
  // (Not HashKey(h): for h = 0 that is 0, a step of 1 that the multiply
  // maps every position onto one counter.)
  const uint64_t step = HashKey(h ^ 0x632be59bd9b4e019ULL) | 1;
  return Reduce(base + static_cast<uint64_t>(k) * step, counters_);
}

uint64_t CountingBloomFilter::Count(uint64_t h) const {
  if (!enabled()) return 0;
  const uint8_t* base = data_;
  uint64_t least = UINT64_MAX;
  for (int k = 0; k < hashes_; ++k) {
    const uint64_t i = Slot(h, k);
    // A page never written holds zeros: not read, so that counting keys
    // maps no page of the filter.
    if (!PageWritten((i * static_cast<uint64_t>(bytes_)) >> page_shift_)) return 0;
    least = std::min(least, GetCounter(base, i, bytes_));
  }
  return least;
}

uint64_t CountingBloomFilter::Add(uint64_t h) {
  uint8_t* base = data_;
  // Each distinct position once per sighting: in a small filter two of a
  // key's k positions may coincide, and counting that counter twice would
  // let a key pass the threshold on fewer sightings than it has.
  uint64_t small[64];
  std::vector<uint64_t> large;
  uint64_t* pos = small;
  if (hashes_ > 64) {
    large.resize(hashes_);
    pos = large.data();
  }
  int distinct = 0;
  for (int k = 0; k < hashes_; ++k) {
    const uint64_t i = Slot(h, k);
    bool seen = false;
    for (int j = 0; j < distinct && !seen; ++j) seen = pos[j] == i;
    if (!seen) pos[distinct++] = i;
  }
  for (int j = 0; j < distinct; ++j) {
    MarkPage(pos[j]);
    BumpCounter(base, pos[j], bytes_);
  }
  return Count(h);
}

size_t CountingBloomFilter::StateBytes() const {
  return enabled() ? size_ + sizeof(kBloomMagic) : 0;
}

void CountingBloomFilter::VisitState(
    const std::function<void(const uint8_t*, size_t)>& sink) const {
  if (!enabled()) return;
  static const uint8_t kZeros[1 << 16] = {};
  uint64_t page = 0;
  while (page < pages_) {
    const bool written = PageWritten(page);
    uint64_t end = page + 1;
    while (end < pages_ && PageWritten(end) == written) ++end;
    const size_t begin = static_cast<size_t>(page) << page_shift_;
    const size_t stop = std::min(size_, static_cast<size_t>(end) << page_shift_);
    if (written) {
      sink(data_ + begin, stop - begin);
    } else {
      for (size_t at = begin; at < stop; at += sizeof(kZeros)) {
        sink(kZeros, std::min(sizeof(kZeros), stop - at));
      }
    }
    page = end;
  }
  sink(reinterpret_cast<const uint8_t*>(kBloomMagic), sizeof(kBloomMagic));
}

void CountingBloomFilter::CopyState(uint8_t* dst) const {
  VisitState([&](const uint8_t* p, size_t n) {
    std::memcpy(dst, p, n);
    dst += n;
  });
}

std::vector<uint8_t> CountingBloomFilter::State() const {
  std::vector<uint8_t> state(StateBytes());
  if (!state.empty()) CopyState(state.data());
  return state;
}

bool CountingBloomFilter::SetState(const uint8_t* state, size_t size) {
  if (!enabled() || size != StateBytes()) return false;
  if (std::memcmp(state + size_, kBloomMagic, sizeof(kBloomMagic)) != 0) return false;
  Clear();
  return LoadStatePiece(0, state, size);
}

bool CountingBloomFilter::LoadStatePiece(uint64_t offset, const uint8_t* piece, size_t n) {
  if (!enabled() || offset > StateBytes() || n > StateBytes() - offset) return false;
  bool marker = true;
  while (n > 0) {
    if (offset >= size_) {
      const size_t at = static_cast<size_t>(offset - size_);
      marker = marker && std::memcmp(piece, kBloomMagic + at, n) == 0;
      break;
    }
    // Up to the end of the page (or of the counters).
    const size_t page_end = static_cast<size_t>(((offset >> page_shift_) + 1) << page_shift_);
    const size_t k =
        std::min({n, page_end - static_cast<size_t>(offset), size_ - static_cast<size_t>(offset)});
    bool zero = true;
    for (size_t j = 0; j < k && zero; ++j) zero = piece[j] == 0;
    if (!zero) {  // pages of zeros stay unallocated (and read as zeros)
      std::memcpy(data_ + offset, piece, k);
      MarkPage(offset / static_cast<uint64_t>(bytes_));
    }
    offset += k;
    piece += k;
    n -= k;
  }
  return marker;
}

void CountingBloomFilter::Clear() {
  if (!enabled()) return;
  // Private anonymous pages read as zeros again after MADV_DONTNEED, and
  // their memory is returned; if that fails, the written pages are zeroed.
  if (::madvise(data_, mapped_bytes_, MADV_DONTNEED) != 0) {
    for (uint64_t page = 0; page < pages_; ++page) {
      if (!PageWritten(page)) continue;
      const size_t begin = static_cast<size_t>(page) << page_shift_;
      std::memset(data_ + begin, 0, std::min(page_, size_ - begin));
    }
    std::memset(written_, 0, mapped_bytes_ - data_bytes_);
  }
  written_pages_ = 0;
}

}  // namespace kv
}  // namespace kre
