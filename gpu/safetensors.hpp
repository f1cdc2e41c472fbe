#pragma once

// Reading Hugging Face `*.safetensors` files (memory-mapped, never copied whole) and their
// sharded index (`model.safetensors.index.json`). Format: an 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}}, then
// the tensor bytes. Every malformed input gives a sentence naming the file and what is wrong.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace baton::gpu {

enum class st_dtype { f32, f16, bf16 };

struct st_tensor {
  st_dtype dtype = st_dtype::f32;
  std::vector<uint64_t> shape;
  const std::byte* data = nullptr;  ///< into the mapping
  uint64_t bytes = 0;
  uint64_t elements() const;
};

/// One mapped file. Tensors point into the mapping, valid while the file object lives.
class safetensors_file {
 public:
  static std::unique_ptr<safetensors_file> open(const std::string& path, std::string* why);
  ~safetensors_file();
  const std::map<std::string, st_tensor>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }

 private:
  safetensors_file() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, st_tensor> tensors_;
};

/// Every tensor of a model directory: model.safetensors, or the shards model.safetensors.index.json
/// names (each shard must hold exactly the tensors the index maps to it).
class safetensors_set {
 public:
  static std::unique_ptr<safetensors_set> open_dir(const std::string& dir, std::string* why);
  /// The tensor, or nullptr.
  const st_tensor* find(const std::string& name) const;
  std::vector<std::string> names() const;
  /// A stable 64-bit fingerprint of the weights, as 16 hex digits: every tensor's name, dtype and
  /// shape, and every byte of its data (read by several threads), so two checkpoints of one
  /// architecture -- a fine-tune, a merged LoRA, new tokens' embeddings -- differ. Past
  /// fingerprint_all_bytes_limit of tensors, bytes sampled evenly through each tensor instead (at
  /// most 65536 samples of 64 bytes in all, at least one per tensor): a sliver of a checkpoint
  /// that each process would otherwise read whole. The same on every machine and run. `salt`
  /// (config.json's text, say) is mixed in first.
  std::string fingerprint(const std::string& salt = {}) const;
  static constexpr uint64_t fingerprint_all_bytes_limit = uint64_t{64} << 30;

 private:
  std::vector<std::unique_ptr<safetensors_file>> files_;
  std::map<std::string, const st_tensor*> by_name_;
};

/// Converts a tensor to fp32 (bf16 and fp16 widened exactly).
std::vector<float> to_f32(const st_tensor& t);
/// Converts elements [first, first + count) of a tensor (flat, row-major): one expert of a fused
/// expert tensor, say, without widening the rest. The range must lie inside the tensor.
std::vector<float> to_f32(const st_tensor& t, uint64_t first, uint64_t count);

/// Writes a safetensors file from fp32 data stored as `dtype` (tests and tools; models come from
/// elsewhere). Returns an error sentence or empty.
struct st_write_tensor {
  std::string name;
  std::vector<uint64_t> shape;
  std::vector<float> values;
  st_dtype dtype = st_dtype::f32;
};
std::string write_safetensors(const std::string& path, const std::vector<st_write_tensor>& tensors);

}  // namespace baton::gpu
