// The machine's floor for the file tier's misses: plain loops, no table.
//
// A file of ROWS records of REC bytes each (written first, so it sits in
// the page cache, as the file tier's segments do on a machine with memory
// to spare), and READS distinct random records of it a step, sorted by
// position (as the file tier reads its misses). Measures, records per
// second, on THREADS threads (each the records of its share of the file):
//   pread_G: the records read with pread, neighbours at most G bytes apart
//            in one call of at most 256 KiB, each record copied out of the
//            call's buffer (the file tier's Prefetch; G = 0, 1, 4, 16 KiB);
//   map:     the records copied out of a read-only shared memory map of the
//            file (the page cache at memory speed: no call per record);
//   append:  as many records appended to a new file in 1 MiB writes (the
//            write-back of the dirty rows the misses evict).
// The best of REPEATS runs, each with fresh positions. Prints one JSON
// object.
//
// Build: g++ -O3 -march=native -o file_probe file_probe.cc
// Run:   file_probe FOLDER ROWS REC READS THREADS REPEATS
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Fail(const char* what, const std::string& path) {
  std::fprintf(stderr, "file_probe: %s %s: %s\n", what, path.c_str(), std::strerror(errno));
  std::exit(1);
}

void WriteAll(int fd, const char* p, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) Fail("write", path);
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void ReadAll(int fd, char* p, size_t n, uint64_t at, const std::string& path) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(at));
    if (r <= 0) Fail("pread", path);
    p += r;
    n -= static_cast<size_t>(r);
    at += static_cast<uint64_t>(r);
  }
}

// READS distinct positions below ROWS, sorted (a partial Fisher-Yates
// shuffle over the identity would need ROWS words; this draws until
// distinct, READS being a small share of ROWS).
std::vector<uint64_t> Positions(uint64_t rows, uint64_t reads, uint64_t seed) {
  std::vector<uint64_t> pos;
  pos.reserve(reads);
  while (pos.size() < reads) {
    while (pos.size() < reads) pos.push_back(Mix(seed++) % rows);
    std::sort(pos.begin(), pos.end());
    pos.erase(std::unique(pos.begin(), pos.end()), pos.end());
  }
  return pos;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: file_probe FOLDER ROWS REC READS THREADS REPEATS\n");
    return 2;
  }
  const std::string folder = argv[1];
  const uint64_t rows = std::strtoull(argv[2], nullptr, 10);
  const uint64_t rec = std::strtoull(argv[3], nullptr, 10);
  const uint64_t reads = std::strtoull(argv[4], nullptr, 10);
  const int threads = std::atoi(argv[5]);
  const int repeats = std::atoi(argv[6]);
  if (rows < 1024 || rec < 8 || rec > 65536 || reads < 1 || reads > rows / 2 || threads < 1 ||
      threads > 256 || repeats < 1) {
    std::fprintf(stderr, "file_probe: bad arguments\n");
    return 2;
  }
  const std::string path = folder + "/file_probe.seg";
  const std::string out_path = folder + "/file_probe.append";
  const uint64_t bytes = rows * rec;
  {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) Fail("open", path);
    std::vector<char> chunk(1 << 20);
    for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<char>(Mix(i));
    for (uint64_t done = 0; done < bytes;) {
      const uint64_t n = std::min<uint64_t>(chunk.size(), bytes - done);
      WriteAll(fd, chunk.data(), n, path);
      done += n;
    }
    ::close(fd);
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) Fail("open", path);
  std::vector<char> out(reads * rec);
  uint64_t check = 0;
  {
    // Reads the whole file once: every page in the page cache before timing.
    std::vector<char> chunk(256 << 10);
    for (uint64_t at = 0; at < bytes; at += chunk.size()) {
      ReadAll(fd, chunk.data(), std::min<uint64_t>(chunk.size(), bytes - at), at, path);
      check += static_cast<unsigned char>(chunk[0]);
    }
  }
  // Runs fn(first, last) over `threads` contiguous shares of [0, reads) at
  // once; returns records per second.
  auto timed = [&](auto fn) {
    std::vector<std::thread> pool;
    const double t0 = Now();
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back(fn, reads * t / threads, reads * (t + 1) / threads);
    }
    for (auto& th : pool) th.join();
    return static_cast<double>(reads) / (Now() - t0);
  };
  const uint64_t gaps[] = {0, 1 << 10, 4 << 10, 16 << 10};
  double pread_best[4] = {0, 0, 0, 0};
  double map_best = 0, append_best = 0;
  uint64_t seed = 1;
  for (int rep = 0; rep < repeats; ++rep) {
    for (int g = 0; g < 4; ++g) {
      const std::vector<uint64_t> pos = Positions(rows, reads, seed);
      seed += reads * 3;
      pread_best[g] = std::max(pread_best[g], timed([&](size_t i, size_t last) {
        std::vector<char> run(256 << 10);
        while (i < last) {
          const uint64_t start = pos[i] * rec;
          uint64_t end = start + rec;
          size_t j = i + 1;
          while (j < last && pos[j] * rec <= end + gaps[g] &&
                 pos[j] * rec + rec - start <= run.size()) {
            end = pos[j] * rec + rec;
            ++j;
          }
          ReadAll(fd, run.data(), end - start, start, path);
          for (size_t k = i; k < j; ++k) {
            std::memcpy(&out[k * rec], &run[pos[k] * rec - start], rec);
          }
          i = j;
        }
      }));
      check += static_cast<unsigned char>(out[(reads / 2) * rec]);
    }
    {
      void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
      if (m == MAP_FAILED) Fail("mmap", path);
      const char* base = static_cast<const char*>(m);
      const std::vector<uint64_t> pos = Positions(rows, reads, seed);
      seed += reads * 3;
      map_best = std::max(map_best, timed([&](size_t first, size_t last) {
        for (size_t k = first; k < last; ++k) {
          if (k + 8 < last) __builtin_prefetch(base + pos[k + 8] * rec);
          std::memcpy(&out[k * rec], base + pos[k] * rec, rec);
        }
      }));
      check += static_cast<unsigned char>(out[(reads / 2) * rec]);
      ::munmap(m, bytes);
    }
    append_best = std::max(append_best, timed([&](size_t first, size_t last) {
      const std::string own = out_path + "." + std::to_string(first);
      const int wfd = ::open(own.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (wfd < 0) Fail("open", own);
      std::vector<char> buffer;
      buffer.reserve(1 << 20);
      for (size_t k = first; k < last; ++k) {
        if (buffer.size() + rec > buffer.capacity()) {
          WriteAll(wfd, buffer.data(), buffer.size(), own);
          buffer.clear();
        }
        buffer.insert(buffer.end(), &out[k * rec], &out[k * rec] + rec);
      }
      WriteAll(wfd, buffer.data(), buffer.size(), own);
      ::close(wfd);
      ::unlink(own.c_str());
    }));
  }
  ::close(fd);
  ::unlink(path.c_str());
  std::printf(
      "{\"rows\": %llu, \"rec_bytes\": %llu, \"reads\": %llu, \"threads\": %d, \"pread_0_per_s\": %.6g, "
      "\"pread_1k_per_s\": %.6g, \"pread_4k_per_s\": %.6g, \"pread_16k_per_s\": %.6g, "
      "\"map_per_s\": %.6g, \"append_per_s\": %.6g, \"checksum\": %llu}\n",
      static_cast<unsigned long long>(rows), static_cast<unsigned long long>(rec),
      static_cast<unsigned long long>(reads), threads, pread_best[0], pread_best[1], pread_best[2],
      pread_best[3], map_best, append_best, static_cast<unsigned long long>(check & 0xffff));
  return 0;
}
