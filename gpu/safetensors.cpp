#include "gpu/safetensors.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string_view>
#include <system_error>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "gpu/json_file.hpp"

namespace baton::gpu {

namespace {

uint32_t dtype_size(st_dtype d) { return d == st_dtype::f32 ? 4 : 2; }

bool parse_dtype(const std::string& s, st_dtype* d) {
  if (s == "F32") *d = st_dtype::f32;
  else if (s == "F16") *d = st_dtype::f16;
  else if (s == "BF16") *d = st_dtype::bf16;
  else return false;
  return true;
}

const char* dtype_name(st_dtype d) {
  switch (d) {
    case st_dtype::f32: return "F32";
    case st_dtype::f16: return "F16";
    case st_dtype::bf16: return "BF16";
  }
  return "?";
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      uint32_t e = 127 - 15 + 1, m = mant;
      while (!(m & 0x400)) {
        m <<= 1;
        --e;
      }
      bits = sign | (e << 23) | ((m & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even (test writer only)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t lsb = (b >> 16) & 1;
  return static_cast<uint16_t>((b + 0x7FFF + lsb) >> 16);
}

uint16_t float_to_half(float f) {  // normal range only, round to nearest (test writer only)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000;
  const int32_t exp = static_cast<int32_t>((b >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7C00);
  const uint32_t mant = (b & 0x7FFFFF) + 0x1000;  // round
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13));
}

/// The first key the top-level object of `text` (already parsed once) lists twice; empty if none.
/// (nlohmann keeps the last of a key given twice, silently: the first parse cannot tell.)
std::string first_repeated_top_level_key(std::string_view text) {
  std::set<std::string> seen;
  std::string twice;
  [[maybe_unused]] const auto skeleton = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && twice.empty() &&
        !seen.insert(parsed.get<std::string>()).second)
      twice = parsed.get<std::string>();
    return depth == 0;  // keep nothing: the values were read by the first parse
  });
  return twice;
}

}  // namespace

uint64_t st_tensor::elements() const {
  uint64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

safetensors_file::~safetensors_file() {
  if (map_) ::munmap(map_, size_);
}

std::unique_ptr<safetensors_file> safetensors_file::open(const std::string& path, std::string* why) {
  auto fail = [&](const std::string& s) -> std::unique_ptr<safetensors_file> {
    *why = path + ": " + s;
    return nullptr;
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(std::strerror(errno));
  struct stat sb {};
  ::fstat(fd, &sb);
  const auto size = static_cast<uint64_t>(sb.st_size);
  if (size < 8) {
    ::close(fd);
    return fail("truncated: " + std::to_string(size) + " bytes, not even a header length");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return fail(std::string{"cannot map: "} + std::strerror(errno));
  std::unique_ptr<safetensors_file> f{new safetensors_file};
  f->path_ = path;
  f->map_ = map;
  f->size_ = size;
  const auto* base = static_cast<const std::byte*>(map);
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);  // little-endian on every platform Baton builds for
  if (header_len > 100'000'000 || 8 + header_len > size)
    return fail("header length " + std::to_string(header_len) + " does not fit the file (" + std::to_string(size) +
                " bytes): truncated or not a safetensors file");
  nlohmann::json header;
  std::string bad;
  const std::string_view header_text{reinterpret_cast<const char*>(base + 8), header_len};
  if (!parse_json_object(header_text, "the header", &header, &bad)) return fail(bad);
  // A name given twice would be read as its last entry (nlohmann keeps one): a writer's bug the
  // file's own loader refuses, so it is refused here too, naming the tensor.
  if (auto twice = first_repeated_top_level_key(header_text); !twice.empty())
    return fail("tensor " + twice + " is listed twice in the header");
  const uint64_t data_size = size - 8 - header_len;
  const auto* data = base + 8 + header_len;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const auto& v = it.value();
    const std::string name = it.key();
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      return fail("tensor " + name + ": needs dtype, shape and two data_offsets");
    st_tensor t;
    if (!parse_dtype(v["dtype"].get<std::string>(), &t.dtype))
      return fail("tensor " + name + ": dtype " + v["dtype"].get<std::string>() + " is not supported (F32, F16, BF16)");
    uint64_t bytes = dtype_size(t.dtype);
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) return fail("tensor " + name + ": shape has a non-integer dimension");
      t.shape.push_back(d.get<uint64_t>());
      // A shape whose byte count wraps 64 bits could otherwise match a small data range.
      if (__builtin_mul_overflow(bytes, t.shape.back(), &bytes))
        return fail("tensor " + name + ": its shape holds more bytes than 2^64");
    }
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      return fail("tensor " + name + ": data_offsets are not integers");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_size)
      return fail("tensor " + name + ": bytes [" + std::to_string(b) + ", " + std::to_string(e) +
                  ") lie outside the data (" + std::to_string(data_size) + " bytes): truncated file?");
    if (e - b != t.elements() * dtype_size(t.dtype))
      return fail("tensor " + name + ": " + std::to_string(e - b) + " bytes for " + std::to_string(t.elements()) +
                  " " + dtype_name(t.dtype) + " values");
    t.data = data + b;
    t.bytes = e - b;
    f->tensors_.emplace(name, t);
  }
  // Two tensors over the same bytes: one of them is not what its name says (safetensors' own
  // loader refuses such a file too).
  std::vector<std::pair<uint64_t, std::string>> starts;  // (offset, name): ties in name order
  for (const auto& [name, t] : f->tensors_)
    if (t.bytes > 0) starts.emplace_back(static_cast<uint64_t>(t.data - data), name);
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i)
    if (starts[i].first < starts[i - 1].first + f->tensors_.at(starts[i - 1].second).bytes)
      return fail("tensors " + starts[i - 1].second + " and " + starts[i].second + " share bytes from " +
                  std::to_string(starts[i].first) + ": overlapping data_offsets");
  return f;
}

std::unique_ptr<safetensors_set> safetensors_set::open_dir(const std::string& dir, std::string* why) {
  std::unique_ptr<safetensors_set> set{new safetensors_set};
  const std::string single = dir + "/model.safetensors", index = dir + "/model.safetensors.index.json";
  std::map<std::string, std::string> weight_map;  // tensor -> shard file
  if (path_exists(index)) {
    std::string text;
    nlohmann::json j;
    if (!read_text_file(index, &text)) {
      *why = index + ": cannot read it";
      return nullptr;
    }
    if (!parse_json_object(text, index, &j, why)) return nullptr;
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
      *why = index + ": not a JSON object with a weight_map";
      return nullptr;
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        *why = index + ": weight_map entry " + it.key() + " is not a file name";
        return nullptr;
      }
      const auto file = it.value().get<std::string>();
      if (file.find('/') != std::string::npos || file.find("..") != std::string::npos) {
        *why = index + ": shard name " + file + " leaves the model directory";
        return nullptr;
      }
      weight_map[it.key()] = file;
    }
    std::map<std::string, size_t> opened;
    for (const auto& [tensor, file] : weight_map) {
      if (!opened.count(file)) {
        auto f = safetensors_file::open(dir + "/" + file, why);
        if (!f) return nullptr;
        opened[file] = set->files_.size();
        set->files_.push_back(std::move(f));
      }
      const auto& tensors = set->files_[opened[file]]->tensors();
      auto t = tensors.find(tensor);
      if (t == tensors.end()) {
        *why = dir + "/" + file + ": the index maps tensor " + tensor + " here, but the shard does not hold it";
        return nullptr;
      }
      set->by_name_[tensor] = &t->second;
    }
  } else if (path_exists(single)) {
    auto f = safetensors_file::open(single, why);
    if (!f) return nullptr;
    for (const auto& [name, t] : f->tensors()) set->by_name_[name] = &t;
    set->files_.push_back(std::move(f));
  } else {
    *why = dir + ": neither model.safetensors nor model.safetensors.index.json";
    return nullptr;
  }
  return set;
}

const st_tensor* safetensors_set::find(const std::string& name) const {
  auto i = by_name_.find(name);
  return i == by_name_.end() ? nullptr : i->second;
}

std::vector<std::string> safetensors_set::names() const {
  std::vector<std::string> out;
  for (const auto& [n, t] : by_name_) out.push_back(n);
  return out;
}

namespace {

/// FNV-1a, 64 bits: simple and stable across machines and builds (the fingerprint names KV
/// blocks on disk, which outlive the process).
struct fnv1a {
  uint64_t h = 0xcbf29ce484222325ull;
  void add(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  }
  void add(uint64_t x) { add(&x, sizeof x); }
  void add(const std::string& s) {
    add(s.size());
    add(s.data(), s.size());
  }
};

/// Every byte of `p`, 64 bits: four multiply-xorshift lanes over 8-byte words (several GB/s a
/// core), a zero-padded tail, folded. Not cryptographic: weights come from whoever runs Baton.
uint64_t content_hash(const unsigned char* p, uint64_t n) {
  constexpr uint64_t k = 0x9E3779B97F4A7C15ull;
  uint64_t lane[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull, 0x082EFA98EC4E6C89ull};
  uint64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      lane[l] = (lane[l] ^ w) * k;
      lane[l] ^= lane[l] >> 29;
    }
  unsigned char tail[32] = {};
  std::memcpy(tail, p + i, n - i);
  for (int l = 0; l < 4; ++l) {
    uint64_t w;
    std::memcpy(&w, tail + 8 * l, 8);
    lane[l] = (lane[l] ^ w) * k;
    lane[l] ^= lane[l] >> 29;
  }
  uint64_t h = n;
  for (uint64_t x : lane) h = (h ^ x) * k, h ^= h >> 31;
  return h;
}

}  // namespace

std::string safetensors_set::fingerprint(const std::string& salt) const {
  // Every byte of checkpoints up to fingerprint_all_bytes_limit: a fine-tune that changed a few
  // rows (new tokens' embeddings) must not pass for its base model, whose KV a shared store would
  // then serve it (a storage review did exactly that when only samples were hashed). Past the
  // limit, where reading everything would cost each process minutes (an expert-parallel process
  // maps only its experts), bytes sampled evenly through each tensor.
  uint64_t total = 0;
  for (const auto& [name, t] : by_name_) total += t->bytes;
  const bool every_byte = total <= fingerprint_all_bytes_limit;
  std::vector<const st_tensor*> tensors;
  for (const auto& [name, t] : by_name_) tensors.push_back(t);
  std::vector<uint64_t> digests(tensors.size());
  if (every_byte) {
    // Several threads: a 16 GB checkpoint is read at memory (or disk) speed, not one core's.
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t k; (k = next.fetch_add(1)) < tensors.size();)
        digests[k] = content_hash(reinterpret_cast<const unsigned char*>(tensors[k]->data), tensors[k]->bytes);
    };
    const size_t n = std::min<size_t>({std::max(1u, std::thread::hardware_concurrency()), 16, tensors.size()});
    std::vector<std::thread> pool;
    pool.reserve(n);  // no allocation can throw between a thread's start and its join
    try {
      for (size_t t = 1; t < n; ++t) pool.emplace_back(work);
    } catch (const std::system_error&) {
      // No more threads (a pids cgroup, RLIMIT_NPROC): those started and this one do it all.
    }
    work();
    for (auto& t : pool) t.join();
  }
  constexpr uint64_t total_samples = 65536, sample_bytes = 64, most_per_tensor = 256;
  const uint64_t per_tensor =
      std::clamp<uint64_t>(total_samples / std::max<size_t>(1, by_name_.size()), 1, most_per_tensor);
  fnv1a f;
  f.add(salt);
  size_t k = 0;
  for (const auto& [name, t] : by_name_) {  // by name: the files' order and sharding do not matter
    f.add(name);
    f.add(static_cast<uint64_t>(t->dtype));
    f.add(t->shape.size());
    for (auto d : t->shape) f.add(d);
    if (every_byte) {
      f.add(digests[k++]);
    } else if (t->bytes <= per_tensor * sample_bytes) {
      f.add(t->data, t->bytes);
    } else {
      const uint64_t last = t->bytes - sample_bytes;  // where the last sample may start
      for (uint64_t s = 0; s < per_tensor; ++s)
        f.add(t->data + (per_tensor == 1 ? last / 2 : last * s / (per_tensor - 1)), sample_bytes);
    }
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(f.h));
  return hex;
}

std::vector<float> to_f32(const st_tensor& t) { return to_f32(t, 0, t.elements()); }

std::vector<float> to_f32(const st_tensor& t, uint64_t first, uint64_t count) {
  std::vector<float> out(count);
  switch (t.dtype) {
    case st_dtype::f32: std::memcpy(out.data(), t.data + 4 * first, 4 * count); break;
    case st_dtype::bf16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * (first + i), 2);
        const uint32_t bits = uint32_t{h} << 16;
        std::memcpy(&out[i], &bits, 4);
      }
      break;
    case st_dtype::f16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * (first + i), 2);
        out[i] = half_to_float(h);
      }
      break;
  }
  return out;
}

std::string write_safetensors(const std::string& path, const std::vector<st_write_tensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::vector<unsigned char> data;
  for (const auto& t : tensors) {
    const uint64_t begin = data.size();
    for (float v : t.values) {
      if (t.dtype == st_dtype::f32) {
        unsigned char b[4];
        std::memcpy(b, &v, 4);
        data.insert(data.end(), b, b + 4);
      } else {
        const uint16_t h = t.dtype == st_dtype::bf16 ? float_to_bf16(v) : float_to_half(v);
        data.push_back(static_cast<unsigned char>(h & 0xFF));
        data.push_back(static_cast<unsigned char>(h >> 8));
      }
    }
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  header["__metadata__"] = {{"format", "pt"}};
  const std::string h = header.dump();
  std::ofstream out{path, std::ios::binary};
  if (!out) return "cannot write " + path;
  const uint64_t len = h.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  return out ? std::string{} : "error while writing " + path;
}

}  // namespace baton::gpu
