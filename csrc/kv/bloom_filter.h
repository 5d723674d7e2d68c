// Copyright keras_rec_emb authors. Apache-2.0.
//
// The counting Bloom filter of CBFFilter: one filter for the whole table
// (sized for the table, not split over shards), counters of 1, 2, 4 or 8
// bytes updated atomically so that shards share it without a lock, and
// saturating. A key's count is the smallest of its k counters.
//
// The counters live in an anonymous mapping reserved but not committed
// (MAP_NORESERVE): the kernel supplies zeroed pages on first write, so the
// memory a filter holds follows the pages its keys' counters fall in, not
// the size it was sized for (DeepRec's max_element_size=2**30 at p=0.01
// sizes 76.7 GiB of uint64 counters). A bitmap of written pages lets
// exports skip pages never written and reports the memory held.
#ifndef KRE_KV_BLOOM_FILTER_H_
#define KRE_KV_BLOOM_FILTER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace kre {
namespace kv {

// Counting Bloom filter parameters for n expected keys and false-positive
// probability p: m = ceil(-n ln p / ln(2)^2) counters, k = round(m/n ln 2).
void BloomSizing(uint64_t n, double p, uint64_t* counters, int* hashes);

class CountingBloomFilter {
 public:
  CountingBloomFilter() = default;
  // counters == 0: no filter. Throws std::invalid_argument for bad sizes,
  // std::bad_alloc when the address space cannot be reserved.
  CountingBloomFilter(uint64_t counters, int hashes, int counter_bytes);
  ~CountingBloomFilter();
  CountingBloomFilter(const CountingBloomFilter&) = delete;
  CountingBloomFilter& operator=(const CountingBloomFilter&) = delete;

  bool enabled() const { return counters_ > 0; }
  // Adds one sighting of hash h; returns the estimated count afterwards.
  uint64_t Add(uint64_t h);
  // The estimated count of hash h.
  uint64_t Count(uint64_t h) const;
  // The counters followed by a format marker (empty without a filter).
  // Callers keep writers out (the table locks its shards).
  std::vector<uint8_t> State() const;
  // State() in pieces, in order, without building it whole: pages never
  // written come from a buffer of zeros, not from the filter's mapping.
  void VisitState(const std::function<void(const uint8_t*, size_t)>& sink) const;
  // Writes State() to dst (StateBytes() bytes).
  void CopyState(uint8_t* dst) const;
  // Restores State() output of a filter of this size; returns whether it
  // did. Pages of zeros in it are not written (they stay unallocated).
  bool SetState(const uint8_t* state, size_t size);
  // Loads bytes [offset, offset + n) of a State() into a filter not written
  // since it was made or cleared, pieces in any order (a state read in
  // chunks is never whole in memory); returns false when bytes of the
  // format marker differ (the counters are then not this layout's).
  bool LoadStatePiece(uint64_t offset, const uint8_t* piece, size_t n);
  bool SetState(const std::vector<uint8_t>& state) { return SetState(state.data(), state.size()); }
  size_t StateBytes() const;
  // Zeroes every counter and hands the pages back.
  void Clear();
  // The bytes of the pages written, plus the bitmap's.
  uint64_t MemoryBytes() const;
  // Exchanges counters with a filter of the same size.
  void SwapCounters(CountingBloomFilter& o);
  bool SameShape(const CountingBloomFilter& o) const {
    return counters_ == o.counters_ && bytes_ == o.bytes_;
  }

 private:
  uint64_t Slot(uint64_t h, int k) const;
  // Records that the page holding counter i is written.
  void MarkPage(uint64_t i);
  bool PageWritten(uint64_t page) const;

  uint64_t counters_ = 0;
  int hashes_ = 0;
  int bytes_ = 8;
  size_t size_ = 0;          // counters_ * bytes_
  size_t page_ = 4096;       // the system's page size
  int page_shift_ = 12;      // log2(page_)
  uint64_t pages_ = 0;       // pages of counters
  size_t data_bytes_ = 0;    // size_ rounded up to whole pages
  size_t mapped_bytes_ = 0;  // data_bytes_ plus the bitmap, whole pages
  // The mapping: counters, naturally aligned for atomics (page-aligned),
  // then one bit per page of counters, set on the page's first write.
  uint8_t* data_ = nullptr;
  uint64_t* written_ = nullptr;
  uint64_t written_pages_ = 0;  // updated atomically
};

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_BLOOM_FILTER_H_
