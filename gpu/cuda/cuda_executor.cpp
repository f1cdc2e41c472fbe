// The CUDA executor (gpu/cuda_executor.hpp says what it is and how its three streams work).
// Compiled only when the build has CUDA; host code, so g++ builds it against the runtime API.

#include "gpu/cuda_executor.hpp"


#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "gpu/cuda/blas_library.hpp"
#include "gpu/cuda/deepseek_path.hpp"
#include "gpu/cuda/device_buffer.hpp"
#include "gpu/cuda/fixed_gemm.hpp"
#include "gpu/cuda/job_plan.hpp"
#include "gpu/cuda/kernels.hpp"
#include "gpu/hf_model.hpp"
#include "gpu/forward_job_check.hpp"
#include "gpu/job_queue.hpp"
#include "gpu/thread_pool.hpp"

namespace baton::gpu {

namespace {

using cuda::device_buffer;
using cuda::dtype;
using cuda::pinned_buffer;
using cuda::for_runs;
using cuda::graph_key;
using cuda::job_args;

struct device_layer {
  device_buffer wqkv, wo, wgu, wdown;            // matrices, `type`
  device_buffer attn_norm, mlp_norm, bqkv, q_norm, k_norm;  // fp32 vectors (bqkv, q/k_norm may be empty)
};

struct layer_note {  // what a host callback on the send stream needs
  executor_sink* sink;
  uint64_t job_id;
  uint32_t layer;
};

void CUDART_CB notify_layer_kv_ready(void* p) {
  auto* n = static_cast<layer_note*>(p);
  n->sink->on_layer_kv_ready(n->job_id, n->layer);
}

class cuda_executor final : public executor, public cuda_executor_extras {
public:
  cuda_executor(model_config cfg, std::shared_ptr<const model_weights> weights, cuda_executor_config ecfg)
    : cfg_(std::move(cfg)),
      ecfg_(ecfg),
      weights_(std::move(weights)),
      type_(ecfg.bf16 ? dtype::bf16 : dtype::f32),
      kv_(model_kv_layout(cfg_, ecfg.num_kv_pages, ecfg.page_size_tokens), ecfg.host_pool),
      dev_gen_(ecfg.num_kv_pages, 0) {}

  ~cuda_executor() override {
    stop();
    for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g.exec);
    if (host_registered_) cudaHostUnregister(kv_.data());
    for (auto* e : events_) cudaEventDestroy(e);
    if (join_) cudaEventDestroy(join_);
    if (blas_) blas_lib_->cublasDestroy(blas_);
    for (auto s : {compute_, copy_, send_})
      if (s) cudaStreamDestroy(s);
  }

  /// Everything that can fail at construction; empty when ready.
  std::string init() {
    if (auto e = ecfg_.validate(); !e.empty()) return "cuda executor config: " + e;
    if (auto e = cfg_.validate(); !e.empty()) return "model config: " + e;
    if (cfg_.head_dim > 256 || cfg_.head_dim % 8)
      return "head_dim " + std::to_string(cfg_.head_dim) + " is not supported by the CUDA attention (a multiple of 8, <= 256)";
    if (!weights_ && !ecfg_.random_weights_seed) return "no weights (and no random_weights_seed)";
    const bool deepseek = cfg_.is_mla() || cfg_.moe.n_routed_experts > 0;
    if (deepseek)
      if (auto e = cuda::deepseek_path::supports(cfg_); !e.empty()) return e;
    if (cuda::device_count() <= ecfg_.device) return "no CUDA device " + std::to_string(ecfg_.device);
    if (!ok(cudaSetDevice(ecfg_.device), "select the device")) return err_;
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, ecfg_.device);
    device_name_ = prop.name;
    // Copy and send outrank compute: their small kernels (scatter, gather) must not queue behind
    // a layer's attention blocks, or the upload one layer ahead falls behind.
    int least = 0, greatest = 0;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (!ok(cudaStreamCreateWithPriority(&compute_, cudaStreamNonBlocking, least), "create a stream") ||
        !ok(cudaStreamCreateWithPriority(&copy_, cudaStreamNonBlocking, greatest), "create a stream") ||
        !ok(cudaStreamCreateWithPriority(&send_, cudaStreamNonBlocking, greatest), "create a stream"))
      return err_;
    std::string why;
    if (!(blas_lib_ = cuda::load_blas(&why))) return why;
    if (!(gemm_ = cuda::fixed_gemm::create(type_, &why))) return why;
    const uint32_t L = cfg_.num_hidden_layers;
    timeline_events_ = ecfg_.record_timeline;
    for (uint32_t i = 0; i < 2 * L + 1 + (ecfg_.record_timeline ? 7 * L : 0); ++i) {
      cudaEvent_t e;
      const unsigned flags = i < 2 * L && !ecfg_.record_timeline ? cudaEventDisableTiming : cudaEventDefault;
      if (!ok(cudaEventCreateWithFlags(&e, flags), "create an event")) return err_;
      events_.push_back(e);
    }
    if (!ok(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), "create an event")) return err_;
    notes_.resize(L);
    const uint64_t pool = uint64_t{L} * kv_.layout().num_pages * page_elems() * cuda::dtype_bytes(type_);
    if (!ok(kv_dev_.grow(pool), "allocate the device KV pool")) return err_;
    if (ecfg_.host_pool && ecfg_.pin_host_pool) {
      // Mapped too, so a kernel can write decode rows' slots straight into it (mirror_rows).
      host_dev_ = static_cast<float*>(cuda::host_register_mapped(kv_.data(), kv_.size_bytes()));
      host_registered_ =
          host_dev_ || cudaHostRegister(kv_.data(), kv_.size_bytes(), cudaHostRegisterPortable) == cudaSuccess;
    }
    cudaGetLastError();  // a refused registration only costs speed
    auto inv = rope_inv_freq(cfg_);
    if (!ok(inv_freq_.grow(inv.size() * 4), "allocate RoPE table") ||
        !ok(cudaMemcpy(inv_freq_.ptr, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice), "upload RoPE table"))
      return err_;
    if (deepseek)
      ds_ = std::make_unique<cuda::deepseek_path>(
          cfg_, type_,
          cuda::layer_services{
              [this](const void* a, const void* w, float* y, uint32_t m, uint32_t n, uint32_t k, float beta) {
                return gemm(a, w, y, m, n, k, beta);
              },
              [this](int rc, const char* what) { return ok_launch(rc, what); },
              [this](device_buffer& d, const std::vector<const std::vector<float>*>& parts, bool matrix) {
                return upload(d, parts, matrix);
              },
              compute_, inv_freq_.as<float>()});
    if (auto e = ecfg_.random_weights_seed ? random_weights() : upload_weights(); !e.empty()) return e;
    uint64_t f = 0;  // the widest always-on MLP (dense layers, or a MoE layer's shared experts)
    for (uint32_t l = 0; l < L; ++l) f = std::max<uint64_t>(f, cfg_.mlp_intermediate(l));
    const uint64_t R = ecfg_.max_batch_tokens, h = cfg_.hidden_size, qd = cfg_.q_dim(), kvd = cfg_.kv_dim(),
                   tb = cuda::dtype_bytes(type_);
    if (!ok(x_.grow(R * h * 4), "allocate activations") || !ok(hn_.grow(R * h * tb), "allocate activations") ||
        !ok(qkv_.grow(cfg_.is_mla() ? 16 : R * (qd + 2 * kvd) * 4), "allocate activations") ||  // MLA: ds_'s own
        !ok(attn_.grow(R * std::max(qd, uint64_t{cfg_.attn_out_dim()}) * tb), "allocate activations") ||
        !ok(gu_.grow(std::max<uint64_t>(R * 2 * f * 4, 16)), "allocate activations") ||
        !ok(act_.grow(std::max<uint64_t>(R * f * tb, 16)), "allocate activations"))
      return err_;
    if (ds_) {
      if (auto e = ds_->reserve(ecfg_.max_batch_tokens); !e.empty()) return e;
      ds_->set_tensor_cores(ecfg_.moe_tensor_cores);
    }
    if (!ok(cudaDeviceSynchronize(), "initialise")) return err_;
    // No picks after every row (picks_every_row() is false): a draft row would take the prefill
    // kernels, whose numbers differ from a decode row's, and speculation would change the tokens.
    jobs_.start([this](const forward_job& job) {
                  if (auto e = row_picks_refusal(job, "the CUDA executor"); !e.empty()) return e;
                  return check_forward_job(job, cfg_, kv_.layout());
                },
                [this](const forward_job& job, executor_sink& sink) { run_job(job, sink); },
                [this] { cudaSetDevice(ecfg_.device); });
    return {};
  }

  void stop() override { jobs_.stop(); }

  const model_config& config() const override { return cfg_; }
  kv_cache& kv() override { return kv_; }
  std::string describe() const override {
    return std::string{"cuda "} + (type_ == dtype::bf16 ? "bf16" : "fp32") + " on " + device_name_ +
           (ecfg_.host_pool ? (host_registered_ ? " (pinned host pool)" : " (pageable host pool)") : " (no host pool)");
  }

  void submit(forward_job job, std::shared_ptr<executor_sink> sink) override { jobs_.submit(std::move(job), std::move(sink)); }

  std::vector<stream_span> last_timeline() const override {
    std::lock_guard<std::mutex> lock{timeline_mutex_};
    return timeline_;
  }

  std::string fill_device_kv_random(const std::vector<uint32_t>& pages, uint64_t seed) override {
    // The whole pool in one launch (one launch per page would be millions); only the listed
    // pages count as held.
    const uint64_t n = kv_dev_.bytes / cuda::dtype_bytes(type_);
    if (cuda::launch_fill_random({kv_dev_.ptr, type_, n, seed, 1.0f, 0.0f}, compute_) != 0 ||
        cudaStreamSynchronize(compute_) != cudaSuccess)
      return "filling the device KV pool failed";
    for (auto p : pages)
      if (p < dev_gen_.size()) dev_gen_[p] = kv_.generation(p);
    return {};
  }

  uint64_t weight_bytes() const override { return weight_bytes_; }
  void set_mirror_to_host(bool on) override { ecfg_.mirror_to_host = on && ecfg_.host_pool; }
  void set_flash_attention(bool on) override { ecfg_.flash_attention = on; }
  void set_mirror_rows(bool on) override { ecfg_.mirror_rows = on; }
  void set_cuda_graphs(bool on) override { ecfg_.cuda_graphs = on; }
  void set_moe_tensor_cores(bool on) override {
    ecfg_.moe_tensor_cores = on;
    if (ds_) ds_->set_tensor_cores(on);
  }
  void set_record_timeline(bool on) override { ecfg_.record_timeline = on && timeline_events_; }
  uint64_t graph_replays() const override { return replays_.load(std::memory_order_relaxed); }
  bool mirrors_rows() const override { return ecfg_.mirror_rows && host_dev_; }

private:
  uint64_t page_elems() const { return uint64_t{cfg_.kv_planes()} * kv_.layout().page_size_tokens * cfg_.kv_dim(); }
  void* kv_layer(uint32_t l) const {
    return static_cast<char*>(kv_dev_.ptr) + uint64_t{l} * kv_.layout().num_pages * page_elems() * cuda::dtype_bytes(type_);
  }

  bool ok(cudaError_t rc, const char* what) {
    if (rc == cudaSuccess) return true;
    if (err_.empty()) err_ = std::string{what} + ": " + cudaGetErrorString(rc);
    return false;
  }
  bool ok_launch(int rc, const char* what) { return ok(static_cast<cudaError_t>(rc), what); }

  // ---- weights ----------------------------------------------------------------------------

  /// Host fp32 -> device `type` (through a fp32 staging buffer, converted on the device with the
  /// same rounding the kernels use).
  std::string upload(device_buffer& dst, const std::vector<const std::vector<float>*>& parts, bool matrix) {
    uint64_t n = 0;
    for (auto* p : parts) n += p->size();
    const dtype t = matrix ? type_ : dtype::f32;
    if (!ok(dst.grow(n * cuda::dtype_bytes(t)), "allocate weights") || !ok(staging_up_[0].grow(n * 4), "allocate staging"))
      return err_;
    uint64_t off = 0;
    for (auto* p : parts) {
      if (!ok(cudaMemcpy(staging_up_[0].as<float>() + off, p->data(), p->size() * 4, cudaMemcpyHostToDevice), "upload weights"))
        return err_;
      off += p->size();
    }
    if (!ok_launch(cuda::launch_convert({staging_up_[0].ptr, dtype::f32, dst.ptr, t, n}, nullptr), "convert weights") ||
        !ok(cudaDeviceSynchronize(), "convert weights"))
      return err_;
    weight_bytes_ += n * cuda::dtype_bytes(t);
    return {};
  }

  std::string upload_weights() {
    const auto& w = *weights_;
    std::string e;
    auto up = [&](device_buffer& d, std::vector<const std::vector<float>*> parts, bool matrix) {
      if (e.empty()) e = upload(d, parts, matrix);
    };
    up(embed_, {&w.embed}, true);
    if (!w.lm_head.empty()) up(lm_head_, {&w.lm_head}, true);
    up(final_norm_, {&w.final_norm}, false);
    layers_ = std::vector<device_layer>(cfg_.num_hidden_layers);
    for (uint32_t l = 0; l < cfg_.num_hidden_layers; ++l) {
      const auto& s = w.layers[l];
      auto& d = layers_[l];
      if (!cfg_.is_mla()) up(d.wqkv, {&s.wq, &s.wk, &s.wv}, true);  // MLA's projections are ds_'s
      up(d.wo, {&s.wo}, true);
      up(d.wgu, {&s.w_gate, &s.w_up}, true);
      up(d.wdown, {&s.w_down}, true);
      up(d.attn_norm, {&s.attn_norm}, false);
      up(d.mlp_norm, {&s.mlp_norm}, false);
      if (!s.bq.empty()) up(d.bqkv, {&s.bq, &s.bk, &s.bv}, false);
      if (!s.q_norm.empty()) {
        up(d.q_norm, {&s.q_norm}, false);
        up(d.k_norm, {&s.k_norm}, false);
      }
    }
    if (ds_ && e.empty()) e = ds_->upload(w);
    staging_up_[0].release();
    return e;
  }

  /// Benchmarks: every tensor drawn on the device (an 8B model in milliseconds, no host copy).
  std::string random_weights() {
    uint64_t seed = ecfg_.random_weights_seed;
    auto fill = [&](device_buffer& d, uint64_t n, bool matrix, float scale, float offset) {
      const dtype t = matrix ? type_ : dtype::f32;
      if (!ok(d.grow(n * cuda::dtype_bytes(t)), "allocate weights")) return;
      ok_launch(cuda::launch_fill_random({d.ptr, t, n, ++seed, scale, offset}, compute_), "draw weights");
      weight_bytes_ += n * cuda::dtype_bytes(t);
    };
    const uint64_t h = cfg_.hidden_size, qd = cfg_.q_dim(), kvd = cfg_.kv_dim(), o = cfg_.attn_out_dim(),
                   v = cfg_.vocab_size;
    fill(embed_, v * h, true, 1.0f, 0.0f);
    if (!cfg_.tie_word_embeddings) fill(lm_head_, v * h, true, 1.0f / std::sqrt(float(h)), 0.0f);
    fill(final_norm_, h, false, 0.1f, 1.0f);
    layers_ = std::vector<device_layer>(cfg_.num_hidden_layers);
    for (uint32_t l = 0; l < cfg_.num_hidden_layers; ++l) {
      auto& d = layers_[l];
      const uint64_t f = cfg_.mlp_intermediate(l);
      if (!cfg_.is_mla()) fill(d.wqkv, (qd + 2 * kvd) * h, true, 1.0f / std::sqrt(float(h)), 0.0f);
      fill(d.wo, h * o, true, 0.5f / std::sqrt(float(o)), 0.0f);
      if (f) {
        fill(d.wgu, 2 * f * h, true, 1.0f / std::sqrt(float(h)), 0.0f);
        fill(d.wdown, h * f, true, 0.5f / std::sqrt(float(f)), 0.0f);
      }
      fill(d.attn_norm, h, false, 0.1f, 1.0f);
      fill(d.mlp_norm, h, false, 0.1f, 1.0f);
    }
    if (ds_) ds_->draw(fill);
    ok(cudaStreamSynchronize(compute_), "draw weights");
    return err_;
  }

  /// y[m][n] (fp32) = beta·y + a[m][k] · w[n][k]ᵀ, a and w of `type_`. A few rows go to our own
  /// weight-streaming kernel; more to cuBLASLt with one algorithm per row bucket (fixed_gemm), so
  /// that a row's bits do not depend on its batch within a bucket.
  bool gemm(const void* a, const void* w, float* y, uint32_t m, uint32_t n, uint32_t k, float beta) {
    if (m <= cuda::gemv_max_rows && k % (16 / cuda::dtype_bytes(type_)) == 0 &&
        uint64_t{m} * k * cuda::dtype_bytes(type_) <= cuda::gemv_max_input_bytes)  // decode-sized: stream the weights once
      return ok_launch(cuda::launch_gemv({a, w, y, m, n, k, beta, type_}, compute_), "gemv");
    if (gemm_ && !gemm_failed_) {
      auto e = gemm_->run(a, w, y, m, n, k, beta, compute_);
      if (e.empty()) return true;
      // Products must go on: say once that batch invariance is lost, and use cuBLAS's own pick.
      // gemm_ itself stays: graphs captured before hold its workspace's address, and freeing
      // memory here could also fall inside a capture, which a free would break.
      std::fprintf(stderr, "baton: cuda executor: %s; matrix products fall back to cuBLAS GemmEx, without batch "
                   "invariance\n", e.c_str());
      gemm_failed_ = true;
    }
    if (!blas_) {
      if (blas_lib_->cublasCreate(&blas_) != CUBLAS_STATUS_SUCCESS) {
        if (err_.empty()) err_ = "cuBLAS could not start";
        return false;
      }
      blas_lib_->cublasSetStream(blas_, compute_);
    }
    const float alpha = 1.0f;
    const auto t = type_ == dtype::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const auto rc = blas_lib_->cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                 static_cast<int>(k), &alpha, w, t, static_cast<int>(k), a, t, static_cast<int>(k), &beta,
                                 y, CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (rc != CUBLAS_STATUS_SUCCESS && err_.empty()) err_ = "cuBLAS GemmEx failed (status " + std::to_string(rc) + ")";
    return rc == CUBLAS_STATUS_SUCCESS;
  }

  // ---- jobs -------------------------------------------------------------------------------

  std::string plan(const forward_job& job, job_args& a) {
    const uint32_t ps = kv_.layout().page_size_tokens, kvd = cfg_.kv_dim();
    std::unordered_map<uint32_t, bool> seen_up, seen_mirror;
    const bool flash = ecfg_.flash_attention && !cfg_.is_mla() && cuda::flash_attention_supported(cfg_.head_dim, type_);
    std::vector<uint32_t> scored;  // prompt scoring's rows: head rows after every sequence's own
    for (const auto& s : job.seqs) {
      const auto first_row = static_cast<uint32_t>(a.tokens.size());
      if (!s.score_targets.empty() && s.score_targets.size() != s.tokens.size())
        return "sequence " + std::to_string(s.seq_id) + ": " + std::to_string(s.score_targets.size()) +
               " score targets for " + std::to_string(s.tokens.size()) + " rows";
      for (uint32_t i = 0; i < s.score_targets.size(); ++i)
        if (s.score_targets[i] >= 0) scored.push_back(first_row + i);
      const bool flash_rows = flash && s.tokens.size() > 1;  // a decode row keeps its kernel whatever shares its job
      const auto table_at = static_cast<uint32_t>(a.page_table.size());
      a.page_table.insert(a.page_table.end(), s.pages.begin(), s.pages.end());
      for (uint32_t i = 0; i < s.tokens.size(); ++i) {
        const uint32_t pos = s.start_pos + i;
        a.tokens.push_back(s.tokens[i]);
        a.positions.push_back(pos);
        a.row_pages.push_back(table_at);
        a.kv_slot.push_back(uint64_t{s.pages[pos / ps]} * page_elems() + uint64_t{pos % ps} * kvd);
        if (flash_rows && i % cuda::flash_tile_rows == 0) {
          a.flash_tiles.push_back(first_row + i);
          a.flash_count.push_back(std::min<uint32_t>(cuda::flash_tile_rows, static_cast<uint32_t>(s.tokens.size()) - i));
        } else if (!flash_rows && i % cuda::attention_tile_rows == 0) {
          a.tiles.push_back(first_row + i);
          a.tile_count.push_back(std::min<uint32_t>(cuda::attention_tile_rows, static_cast<uint32_t>(s.tokens.size()) - i));
        }
      }
      if (s.wants_head()) a.want_rows.push_back(static_cast<uint32_t>(a.tokens.size()) - 1);
      const uint32_t prefix_pages = (s.start_pos + ps - 1) / ps, end_pages = kv_.pages_for_tokens(s.start_pos + uint32_t(s.tokens.size()));
      for (uint32_t i = 0; i < prefix_pages; ++i) {
        const uint32_t p = s.pages[i];
        if (dev_gen_[p] != kv_.generation(p) && !seen_up[p]) {
          seen_up[p] = true;
          a.upload.push_back(p);
        }
      }
      // A few new rows (a decode step) mirror their own slots; more mirror the pages they wrote
      // (fewer, larger copies on the copy engine instead of a kernel's PCIe writes).
      if (ecfg_.mirror_to_host && mirrors_rows() && s.tokens.size() < ps)
        a.mirror_slots.insert(a.mirror_slots.end(), a.kv_slot.end() - static_cast<long>(s.tokens.size()), a.kv_slot.end());
      else
        for (uint32_t i = s.start_pos / ps; ecfg_.mirror_to_host && i < end_pages; ++i)
          if (!seen_mirror[s.pages[i]]) {
            seen_mirror[s.pages[i]] = true;
            a.mirror.push_back(s.pages[i]);
          }
      if (!a.upload.empty() && !ecfg_.host_pool)
        return "sequence " + std::to_string(s.seq_id) + ": its cached prefix is not on the device and this executor has no host pool";
    }
    a.want_rows.insert(a.want_rows.end(), scored.begin(), scored.end());
    if (a.want_rows.size() > ecfg_.max_batch_tokens)  // the head's rows live in buffers of that many
      return "job " + std::to_string(job.job_id) + ": " + std::to_string(a.want_rows.size()) +
             " head rows (scored ones too) exceed max_batch_tokens " + std::to_string(ecfg_.max_batch_tokens);
    if (a.tokens.size() > ecfg_.max_batch_tokens)
      return "job " + std::to_string(job.job_id) + ": " + std::to_string(a.tokens.size()) +
             " rows exceed max_batch_tokens " + std::to_string(ecfg_.max_batch_tokens);
    return {};
  }

  template <typename T>
  static void pack(std::vector<char>& bytes, uint64_t& offset, const std::vector<T>& v) {
    offset = bytes.size();
    const uint64_t n = (v.size() * sizeof(T) + 15) / 16 * 16;
    bytes.resize(bytes.size() + std::max<uint64_t>(n, 16));
    if (!v.empty()) std::memcpy(bytes.data() + offset, v.data(), v.size() * sizeof(T));
  }

  void run_job(const forward_job& job, executor_sink& sink) {
    err_.clear();
    job_args a;
    if (auto e = plan(job, a); !e.empty()) return sink.on_failed(job.job_id, std::move(e));
    std::vector<uint32_t> gen_at_start;
    for (const auto& s : job.seqs)
      for (auto p : s.pages) gen_at_start.push_back(kv_.generation(p));
    // The arrays by slot (dev(i) below). The page table, whose length varies from step to step
    // of the same batch, goes last: a decode job's other offsets then depend on its row counts
    // alone, which a captured graph's kernel arguments need (cuda_graphs).
    std::vector<char> bytes;
    std::vector<uint64_t> off(15);
    pack(bytes, off[0], a.tokens);
    pack(bytes, off[1], a.positions);
    pack(bytes, off[2], a.row_pages);
    pack(bytes, off[4], a.tiles);
    pack(bytes, off[5], a.tile_count);
    pack(bytes, off[6], a.want_rows);
    pack(bytes, off[7], a.upload);
    pack(bytes, off[8], a.mirror);
    pack(bytes, off[9], a.kv_slot);
    pack(bytes, off[10], a.flash_tiles);
    pack(bytes, off[11], a.flash_count);
    const uint64_t pe = page_elems();
    const uint32_t n = static_cast<uint32_t>(a.tokens.size()), nw = static_cast<uint32_t>(a.want_rows.size());
    // Head rows whose logits go to the host: asked for, or sampled there (top-k, top-p,
    // penalties). Greedy rows and plain draws at a temperature are picked on the device and only
    // their token comes back (picks in tokens[0, nw), draws in tokens[nw, 2 nw)).
    std::vector<uint32_t> host_rows;
    std::vector<float> temperature(nw, 1.0f);  // per head row
    std::vector<double> draw(nw, -1.0);  // -1: the row makes no draw
    bool device_picks = false, device_draws = false;
    for (uint32_t s = 0, k = 0; s < job.seqs.size(); ++s) {
      const auto& q = job.seqs[s];
      if (!q.wants_head()) continue;
      const bool on_device = q.sample && (q.sample->plain_greedy() || q.sample->plain_draw());
      if (q.want_logits || !on_device) host_rows.push_back(k);
      device_picks |= q.sample && q.sample->plain_greedy();
      if (q.sample && q.sample->plain_draw()) {
        device_draws = true;
        temperature[k] = q.sample->cfg.temperature;
        draw[k] = draw_uniform(q.sample->cfg.seed, q.sample->position);
      }
      ++k;
    }
    for (uint32_t k = nw - static_cast<uint32_t>(scored_rows_of(job)); k < nw; ++k) host_rows.push_back(k);  // scored rows
    pack(bytes, off[12], temperature);
    pack(bytes, off[13], draw);
    pack(bytes, off[14], a.mirror_slots);
    pack(bytes, off[3], a.page_table);
    if (!ok(args_host_.grow(bytes.size()), "pin job arguments") || !ok(args_dev_.grow(bytes.size()), "allocate job arguments") ||
        !ok(tokens_host_.grow(uint64_t{std::max(nw, 1u)} * 8), "pin tokens") ||
        !ok(tokens_dev_.grow(uint64_t{std::max(nw, 1u)} * 8), "allocate tokens") ||
        !ok(logits_host_.grow(uint64_t{std::max(nw, 1u)} * cfg_.vocab_size * 4), "pin logits") ||
        !ok(logits_dev_.grow(uint64_t{std::max(nw, 1u)} * cfg_.vocab_size * 4), "allocate logits") ||
        !ok(staging_up_[0].grow(std::max<uint64_t>(a.upload.size(), 1) * pe * 4), "allocate upload staging") ||
        !ok(staging_up_[1].grow(std::max<uint64_t>(a.upload.size(), 1) * pe * 4), "allocate upload staging") ||
        !ok(staging_send_[0].grow(std::max<uint64_t>(a.mirror.size(), 1) * pe * 4), "allocate send staging") ||
        !ok(staging_send_[1].grow(std::max<uint64_t>(a.mirror.size(), 1) * pe * 4), "allocate send staging"))
      return sink.on_failed(job.job_id, "cuda executor: job " + std::to_string(job.job_id) + ": " + err_);
    // A pure decode job (one row per tile) over long contexts splits each row's positions into
    // fixed ranges of split_positions, one block each: the split grid depends on positions alone,
    // so a row's result does not depend on its batch-mates. Mixed jobs keep one block per tile.
    const uint32_t max_len = *std::max_element(a.positions.begin(), a.positions.end()) + 1;
    const bool pure_decode = a.flash_tiles.empty() && a.tiles.size() == n;
    // Decode rows (and, with the tensor-core kernel taking prefill rows, every CUDA-core tile)
    // hold one row: the attention kernel's variant for them skips the absent rows' work.
    const bool single_row_tiles =
        std::all_of(a.tile_count.begin(), a.tile_count.end(), [](uint32_t c) { return c == 1; });
    // 256: a batch-1 step at 1K context then runs 4 blocks per KV head instead of 2; each
    // block's chunks of 128 positions are serial, so fewer per block is lower latency.
    const uint32_t split_positions = 256;
    const uint32_t splits = pure_decode && max_len > split_positions ? (max_len + split_positions - 1) / split_positions : 1;
    if (splits > 1 &&
        !ok(partial_.grow(uint64_t{splits} * n * cfg_.num_attention_heads *
                          ((cfg_.is_mla() ? cfg_.mla.kv_lora_rank : cfg_.head_dim) + 2) * 4),
            "allocate attention partials"))
      return sink.on_failed(job.job_id, "cuda executor: job " + std::to_string(job.job_id) + ": " + err_);
    std::memcpy(args_host_.ptr, bytes.data(), bytes.size());
    auto dev = [&](size_t i) { return static_cast<char*>(args_dev_.ptr) + off[i]; };
    // A job a graph can replay: decode rows only (no prefill tiles), nothing to upload, mirrored
    // slot by slot or not at all, its logits (if any) for every head row in one copy, and no
    // timeline. Its kernels' arguments then depend only on the key below and on buffers whose
    // addresses the graph records (graph_buffers).
    const bool graphable = ecfg_.cuda_graphs && graphs_work_ && !ecfg_.record_timeline && pure_decode &&
                           a.upload.empty() && a.mirror.empty() && (host_rows.empty() || host_rows.size() == nw);
    const graph_key key{n, nw, splits, a.mirror_slots.size(), device_picks, device_draws, !host_rows.empty()};
    const uint32_t L = cfg_.num_hidden_layers;
    cudaEvent_t* up_done = events_.data();
    cudaEvent_t* kv_written = events_.data() + L;
    cudaEvent_t args_ready = events_[2 * L];
    cudaEvent_t* tl = ecfg_.record_timeline ? events_.data() + 2 * L + 1 : nullptr;  // 7 per layer
    for (uint32_t l = 0; l < L; ++l) notes_[l] = {&sink, job.job_id, l};  // read by the send stream's host callbacks
    std::string failed_at;  // set when a gate fails

    // Everything the job puts on the streams. `capturing`: into a graph on compute_ (see
    // run_graph), which the send stream joins through args_ready and leaves through join_;
    // the copy stream has nothing to do in such a job.
    auto enqueue = [&](bool capturing) {
      // A graph copies the arguments' whole buffer: a later job of the same key may have a longer
      // page table (the buffers' sizes are part of graph_buffers, so it still fits).
      const uint64_t arg_bytes = capturing ? std::min(args_host_.bytes, args_dev_.bytes) : bytes.size();
      ok(cudaMemcpyAsync(args_dev_.ptr, args_host_.ptr, arg_bytes, cudaMemcpyHostToDevice, compute_), "copy job arguments");
      ok(cudaEventRecord(args_ready, compute_), "record an event");
      if (!capturing) ok(cudaStreamWaitEvent(copy_, args_ready, 0), "order the copy stream");
      ok(cudaStreamWaitEvent(send_, args_ready, 0), "order the send stream");
      ok_launch(cuda::launch_embed({embed_.ptr, reinterpret_cast<int32_t*>(dev(0)), x_.as<float>(), n, cfg_.hidden_size, type_}, compute_),
                "embed");

      auto enqueue_upload = [&](uint32_t l) {
        if (a.upload.empty()) return true;
        for (const auto& s : job.seqs)
          if (s.gate && !s.gate->wait(l)) {
            failed_at = "sequence " + std::to_string(s.seq_id) + ": layer " + std::to_string(l) +
                        " of its cached prefix will not arrive";
            return false;
          }
        if (tl) ok(cudaEventRecord(tl[7 * l + 2], copy_), "record an event");
        float* staging = staging_up_[l % 2].as<float>();
        for_runs(a.upload, [&](size_t i, size_t count) {
          ok(cudaMemcpyAsync(staging + i * pe, kv_.k_at(l, a.upload[i], 0), count * pe * 4, cudaMemcpyHostToDevice, copy_),
             "upload KV pages");
        });
        if (tl) ok(cudaEventRecord(tl[7 * l + 6], copy_), "record an event");  // the PCIe part ends
        ok_launch(cuda::launch_kv_scatter({kv_layer(l), staging, reinterpret_cast<uint32_t*>(dev(7)),
                                           static_cast<uint32_t>(a.upload.size()), pe, type_}, copy_),
                  "scatter uploaded KV");
        ok(cudaEventRecord(up_done[l], copy_), "record an event");
        if (tl) ok(cudaEventRecord(tl[7 * l + 3], copy_), "record an event");
        return true;
    };

    const uint32_t h = cfg_.hidden_size, qd = cfg_.q_dim(), kvd = cfg_.kv_dim(), ps = kv_.layout().page_size_tokens;
    bool going = err_.empty() && enqueue_upload(0);
    for (uint32_t l = 0; going && l < L; ++l) {
      const auto& w = layers_[l];
      if (tl) ok(cudaEventRecord(tl[7 * l + 0], compute_), "record an event");
      ok_launch(cuda::launch_rmsnorm_cast({x_.as<float>(), nullptr, w.attn_norm.as<float>(), hn_.ptr, n, h, cfg_.rms_norm_eps, type_}, compute_),
                "attention norm");
      const cuda::row_args rows{n, reinterpret_cast<uint32_t*>(dev(1)), reinterpret_cast<uint32_t*>(dev(3)),
                                reinterpret_cast<uint32_t*>(dev(2)), reinterpret_cast<uint64_t*>(dev(9)), ps, pe,
                                splits, split_positions, partial_.as<float>()};
      if (cfg_.is_mla()) {  // the latent is written by write_latent, after any upload into its pages
        if (!a.upload.empty()) ok(cudaStreamWaitEvent(compute_, up_done[l], 0), "wait for the upload");
        ds_->write_latent(l, hn_.ptr, rows, kv_layer(l));
      } else {
        gemm(hn_.ptr, w.wqkv.ptr, qkv_.as<float>(), n, qd + 2 * kvd, h, 0.0f);
        // The new rows' K and V land in pages an upload may also fill (a prefix's last page).
        if (!a.upload.empty()) ok(cudaStreamWaitEvent(compute_, up_done[l], 0), "wait for the upload");
        ok_launch(cuda::launch_qkv_finish({qkv_.as<float>(), w.bqkv.as<float>(), w.q_norm.as<float>(), w.k_norm.as<float>(),
                                           inv_freq_.as<float>(), reinterpret_cast<uint32_t*>(dev(1)),
                                           reinterpret_cast<uint64_t*>(dev(9)), kv_layer(l), n, cfg_.num_attention_heads,
                                           cfg_.num_key_value_heads, cfg_.head_dim, kv_.layout().page_size_tokens,
                                           cfg_.rms_norm_eps, type_},
                                          compute_),
                  "qkv bias/norm/rope/store");
      }
      ok(cudaEventRecord(kv_written[l], compute_), "record an event");
      if (cfg_.is_mla()) {
        ds_->attend(l, rows, kv_layer(l), w.wo.ptr, x_.as<float>(), attn_.ptr);
      } else {
        ok_launch(cuda::launch_attention({qkv_.as<float>(), qd + 2 * kvd, kv_layer(l), reinterpret_cast<uint32_t*>(dev(1)),
                                          reinterpret_cast<uint32_t*>(dev(3)), reinterpret_cast<uint32_t*>(dev(2)),
                                          reinterpret_cast<uint32_t*>(dev(4)), static_cast<uint32_t>(a.tiles.size()),
                                          single_row_tiles ? 1u : cuda::attention_tile_rows,
                                          reinterpret_cast<uint32_t*>(dev(5)), attn_.ptr, n,
                                          splits, split_positions, partial_.as<float>(), cfg_.num_attention_heads,
                                          cfg_.num_key_value_heads, cfg_.head_dim, kv_.layout().page_size_tokens, pe,
                                          1.0f / std::sqrt(float(cfg_.head_dim)), type_},
                                         compute_),
                  "attention");
        ok_launch(cuda::launch_flash_attention(
                      {qkv_.as<float>(), qd + 2 * kvd, kv_layer(l), reinterpret_cast<uint32_t*>(dev(1)),
                       reinterpret_cast<uint32_t*>(dev(3)), reinterpret_cast<uint32_t*>(dev(2)),
                       reinterpret_cast<uint32_t*>(dev(10)), static_cast<uint32_t>(a.flash_tiles.size()),
                       cuda::flash_tile_rows, reinterpret_cast<uint32_t*>(dev(11)), attn_.ptr, n, 1, split_positions,
                       nullptr, cfg_.num_attention_heads, cfg_.num_key_value_heads, cfg_.head_dim,
                       kv_.layout().page_size_tokens, pe, 1.0f / std::sqrt(float(cfg_.head_dim)), type_},
                      compute_),
                  "tensor-core attention");
        gemm(attn_.ptr, w.wo.ptr, x_.as<float>(), n, h, qd, 1.0f);
      }
      ok_launch(cuda::launch_rmsnorm_cast({x_.as<float>(), nullptr, w.mlp_norm.as<float>(), hn_.ptr, n, h, cfg_.rms_norm_eps, type_}, compute_),
                "mlp norm");
      const uint32_t f = cfg_.mlp_intermediate(l);
      if (cfg_.is_moe_layer(l)) {
        ds_->moe(l, n, x_.as<float>(), w.mlp_norm.as<float>(), hn_.ptr, {w.wgu.ptr, w.wdown.ptr, f, gu_.as<float>(), act_.ptr});
      } else {
        gemm(hn_.ptr, w.wgu.ptr, gu_.as<float>(), n, 2 * f, h, 0.0f);
        ok_launch(cuda::launch_swiglu({gu_.as<float>(), act_.ptr, n, f, type_}, compute_), "swiglu");
        gemm(act_.ptr, w.wdown.ptr, x_.as<float>(), n, h, f, 1.0f);
      }
      if (tl) ok(cudaEventRecord(tl[7 * l + 1], compute_), "record an event");

      // Send stream: mirror the layer's new KV to the host pool, then tell the sink.
      ok(cudaStreamWaitEvent(send_, kv_written[l], 0), "order the send stream");
      if (tl) ok(cudaEventRecord(tl[7 * l + 4], send_), "record an event");
      if (!a.mirror.empty()) {
        float* staging = staging_send_[l % 2].as<float>();
        ok_launch(cuda::launch_kv_gather({kv_layer(l), staging, reinterpret_cast<uint32_t*>(dev(8)),
                                          static_cast<uint32_t>(a.mirror.size()), pe, type_}, send_),
                  "gather KV to mirror");
        for_runs(a.mirror, [&](size_t i, size_t count) {
          ok(cudaMemcpyAsync(kv_.k_at(l, a.mirror[i], 0), staging + i * pe, count * pe * 4, cudaMemcpyDeviceToHost, send_),
             "mirror KV pages");
        });
      }
      if (!a.mirror_slots.empty())
        ok_launch(cuda::launch_kv_rows_to_host({kv_layer(l), host_dev_ + uint64_t{l} * kv_.layout().layer_stride_bytes() / 4,
                                                reinterpret_cast<uint64_t*>(dev(14)),
                                                static_cast<uint32_t>(a.mirror_slots.size()), kvd,
                                                uint64_t{kv_.layout().page_size_tokens} * kvd, cfg_.kv_planes(), type_},
                                               send_),
                  "mirror decode rows' KV");
      if (tl) ok(cudaEventRecord(tl[7 * l + 5], send_), "record an event");
      ok(cudaLaunchHostFunc(send_, notify_layer_kv_ready, &notes_[l]), "queue the layer notice");
      going = err_.empty() && (l + 1 == L || enqueue_upload(l + 1));
    }
    if (going) {
      ok_launch(cuda::launch_rmsnorm_cast({x_.as<float>(), reinterpret_cast<uint32_t*>(dev(6)), final_norm_.as<float>(),
                                           hn_.ptr, nw, h, cfg_.rms_norm_eps, type_}, compute_),
                "final norm");
      const uint64_t v = cfg_.vocab_size;
      if (nw) gemm(hn_.ptr, lm_head_.ptr ? lm_head_.ptr : embed_.ptr, logits_dev_.as<float>(), nw, cfg_.vocab_size, h, 0.0f);
      if (device_picks)
        ok_launch(cuda::launch_argmax({logits_dev_.as<float>(), tokens_dev_.as<int32_t>(), nw, cfg_.vocab_size}, compute_),
                  "greedy pick");
      if (device_draws)
        ok_launch(cuda::launch_draw({logits_dev_.as<float>(), reinterpret_cast<float*>(dev(12)),
                                     reinterpret_cast<double*>(dev(13)), tokens_dev_.as<int32_t>() + nw, nw,
                                     cfg_.vocab_size},
                                    compute_),
                  "draw");
      if (device_picks || device_draws)
        ok(cudaMemcpyAsync(tokens_host_.ptr, tokens_dev_.ptr, uint64_t{nw} * 8, cudaMemcpyDeviceToHost, compute_),
           "copy picked tokens");
      for_runs(host_rows, [&](size_t i, size_t count) {
        ok(cudaMemcpyAsync(static_cast<float*>(logits_host_.ptr) + host_rows[i] * v, logits_dev_.as<float>() + host_rows[i] * v,
                           count * v * 4, cudaMemcpyDeviceToHost, compute_),
           "copy logits");
      });
    }
    if (capturing) {  // the send stream rejoins compute_, as a capture must end
      ok(cudaEventRecord(join_, send_), "record an event");
      ok(cudaStreamWaitEvent(compute_, join_, 0), "join the send stream");
    }
    return going;
    };
    if (!graphable || !run_graph(key, enqueue)) (void)enqueue(false);
    // The job's end: the one place the host waits for the device.
    ok(cudaStreamSynchronize(compute_), "run the job");
    ok(cudaStreamSynchronize(copy_), "upload KV");
    ok(cudaStreamSynchronize(send_), "mirror KV");
    if (tl) collect_timeline(tl, L, a.upload.empty());
    if (!failed_at.empty()) return sink.on_failed(job.job_id, failed_at);
    if (!err_.empty())
      return sink.on_failed(job.job_id, "cuda executor: job " + std::to_string(job.job_id) + " (" +
                                            std::to_string(job.seqs.size()) + " sequences, first " +
                                            std::to_string(job.seqs.front().seq_id) + "): " + err_);
    size_t g = 0;
    for (const auto& s : job.seqs)
      for (auto p : s.pages) dev_gen_[p] = gen_at_start[g++];
    std::vector<std::vector<float>> logits(job.seqs.size());
    std::vector<int32_t> tokens(job.seqs.size(), -1);
    const float* lh = static_cast<const float*>(logits_host_.ptr);
    const auto* picked = static_cast<const int32_t*>(tokens_host_.ptr);
    std::vector<std::pair<size_t, size_t>> drawn;  // (sequence, head row) picked on the host
    for (size_t s = 0, k = 0; s < job.seqs.size(); ++s) {
      const auto& q = job.seqs[s];
      if (!q.wants_head()) continue;
      const float* row = lh + k * cfg_.vocab_size;
      if (q.want_logits) logits[s].assign(row, row + cfg_.vocab_size);
      if (q.sample && q.sample->plain_greedy())
        tokens[s] = picked[k];
      else if (q.sample && q.sample->plain_draw())
        tokens[s] = picked[nw + k];
      else if (q.sample)
        drawn.emplace_back(s, k);
      ++k;
    }
    // A draw reads its whole row (an exp per logit, a partial sort for top-k/top-p: a few ms
    // at a 150K vocabulary), so a batch's draws run on the sampler threads.
    sampler_.parallel_for(drawn.size(), 1, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        const auto [s, k] = drawn[i];
        const auto& q = job.seqs[s];
        thread_local sampling_scratch scratch;  // each sampler thread's, reused across rows and jobs
        tokens[s] = sample_token(std::span<const float>(lh + k * cfg_.vocab_size, cfg_.vocab_size), *q.sample, &scratch);
      }
    });
    // Log-probabilities read the pick's row on the host (plain_greedy/plain_draw are false for
    // such rows, so it came back).
    std::vector<token_logprobs> logprobs;
    for (const auto& [s, k] : drawn)
      if (job.seqs[s].sample->want_logprobs) {
        logprobs.resize(job.seqs.size());
        logprobs[s] = logprobs_of(std::span<const float>(lh + k * cfg_.vocab_size, cfg_.vocab_size), tokens[s],
                                  job.seqs[s].sample->top_logprobs);
      }
    // Scored rows (prompt scoring) follow the head rows, in sequence and row order.
    struct scored_row {
      size_t seq, head_row, row, slot;  // slot: its place in the sequence's scores
    };
    std::vector<scored_row> score_at;
    for (size_t s = 0, k = nw - scored_rows_of(job); s < job.seqs.size(); ++s)
      for (size_t i = 0, slot = 0; i < job.seqs[s].score_targets.size(); ++i)
        if (job.seqs[s].score_targets[i] >= 0) score_at.push_back({s, k++, i, slot++});
    std::vector<std::vector<token_logprobs>> scores;
    if (!score_at.empty()) {
      scores.resize(job.seqs.size());
      for (size_t s = 0; s < job.seqs.size(); ++s) scores[s].resize(scored_rows(job.seqs[s].score_targets));
      sampler_.parallel_for(score_at.size(), 8, [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) {
          const auto& r = score_at[i];
          const auto& q = job.seqs[r.seq];
          scores[r.seq][r.slot] = logprobs_of(std::span<const float>(lh + r.head_row * cfg_.vocab_size, cfg_.vocab_size),
                                              q.score_targets[r.row], q.score_top);
        }
      });
    }
    sink.on_done(job.job_id, {std::move(logits), std::move(tokens), std::move(logprobs), std::move(scores)});
  }

  /// Rows of `job` that prompt scoring reads the head of.
  static size_t scored_rows_of(const forward_job& job) {
    size_t n = 0;
    for (const auto& q : job.seqs) n += scored_rows(q.score_targets);
    return n;
  }

  /// The addresses (and the argument buffers' sizes) a captured graph has baked in: when one
  /// changes (a buffer grew), the key's graph is captured again.
  std::array<uintptr_t, 14> graph_buffers() const {
    auto at = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
    return {at(args_dev_.ptr), at(args_host_.ptr), std::min(args_host_.bytes, args_dev_.bytes), at(x_.ptr), at(hn_.ptr),
            at(qkv_.ptr), at(attn_.ptr), at(gu_.ptr), at(act_.ptr), at(logits_dev_.ptr), at(logits_host_.ptr),
            at(tokens_dev_.ptr), at(tokens_host_.ptr), at(partial_.ptr)};
  }

  /// Runs a decode job as one graph launch (cuda_graphs): about a dozen kernels per layer cost a
  /// launch each otherwise, which small batches cannot hide. The key's graph is replayed when
  /// its buffers are the same; else it is captured, but only on the key's second job: the first
  /// runs launched, so shapes seen once cost no capture, and every kernel's one-time setup (a
  /// shared-memory limit, cuBLASLt's algorithm choice) happens outside a capture. False: the job
  /// was not run (the caller launches it). A capture that fails turns graphs off, said once.
  template <typename Enqueue>
  bool run_graph(const graph_key& key, Enqueue& enqueue) {
    const auto buffers = graph_buffers();
    auto it = graphs_.find(key);
    if (it != graphs_.end() && it->second.buffers != buffers) {
      cudaGraphExecDestroy(it->second.exec);
      graphs_.erase(it);
      it = graphs_.end();
    }
    if (it == graphs_.end()) {
      if (graphs_seen_.insert(key).second) return false;
      if (graphs_.size() >= 256) {  // batch sizes x context splits: far fewer in practice
        for (auto& [k, g] : graphs_) cudaGraphExecDestroy(g.exec);
        graphs_.clear();
      }
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      cudaError_t rc = cudaStreamBeginCapture(compute_, cudaStreamCaptureModeThreadLocal);
      if (rc == cudaSuccess) {
        (void)enqueue(true);
        rc = cudaStreamEndCapture(compute_, &graph);
      }
      if (rc == cudaSuccess && err_.empty()) rc = cudaGraphInstantiate(&exec, graph, 0);
      if (graph) cudaGraphDestroy(graph);
      if (rc != cudaSuccess || !err_.empty()) {
        const std::string why = err_.empty() ? cudaGetErrorString(rc) : err_;
        err_.clear();
        cudaGetLastError();
        graphs_work_ = false;
        std::fprintf(stderr, "baton: cuda executor: capturing a decode step into a CUDA graph failed (%s); steps are "
                     "launched from now on\n", why.c_str());
        return false;
      }
      it = graphs_.emplace(key, captured_graph{exec, buffers}).first;
    }
    replays_.fetch_add(1, std::memory_order_relaxed);
    ok(cudaGraphLaunch(it->second.exec, compute_), "launch a captured decode step");
    return true;  // a failed launch fails the job through err_
  }

  void collect_timeline(cudaEvent_t* tl, uint32_t L, bool no_upload) {
    std::vector<stream_span> spans;
    auto at = [&](cudaEvent_t e) {
      float ms = 0;
      cudaEventElapsedTime(&ms, tl[0], e);
      return double{ms};
    };
    for (uint32_t l = 0; l < L; ++l) {
      spans.push_back({"compute", l, at(tl[7 * l]), at(tl[7 * l + 1])});
      if (!no_upload) {
        spans.push_back({"copy", l, at(tl[7 * l + 2]), at(tl[7 * l + 3])});
        spans.push_back({"copy-h2d", l, at(tl[7 * l + 2]), at(tl[7 * l + 6])});
      }
      spans.push_back({"send", l, at(tl[7 * l + 4]), at(tl[7 * l + 5])});
    }
    cudaGetLastError();
    std::lock_guard<std::mutex> lock{timeline_mutex_};
    timeline_ = std::move(spans);
  }

  model_config cfg_;
  cuda_executor_config ecfg_;
  std::shared_ptr<const model_weights> weights_;
  dtype type_;
  kv_cache kv_;
  std::vector<uint32_t> dev_gen_;  ///< per page: the host generation the device copy holds (0: none)
  std::string device_name_;
  std::string err_;                ///< the first CUDA failure of the current job
  bool host_registered_ = false;
  float* host_dev_ = nullptr;      ///< the host pool's device-side address (page-locked and mapped), or null
  uint64_t weight_bytes_ = 0;

  cudaStream_t compute_ = nullptr, copy_ = nullptr, send_ = nullptr;
  /// Host threads for the rows picked on the host (top-k, top-p or penalties).
  thread_pool sampler_{std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u)};
  std::unique_ptr<cuda::fixed_gemm> gemm_;  ///< products of many rows (the job thread only); null if it could not start
  bool gemm_failed_ = false;                ///< a product failed: the rest use cuBLAS GemmEx
  const cuda::blas_library* blas_lib_ = nullptr;  ///< loaded at start (gpu/cuda/blas_library.hpp)
  cublasHandle_t blas_ = nullptr;           ///< the fallback when fixed_gemm fails: cuBLAS's own pick
  std::vector<cudaEvent_t> events_;
  cudaEvent_t join_ = nullptr;       ///< a captured job's send stream rejoins compute_ here
  bool timeline_events_ = false;     ///< events_ holds the timeline's (record_timeline at start)
  std::vector<layer_note> notes_;    ///< [layer]: the current job's, for the send stream's host callbacks

  struct captured_graph {
    cudaGraphExec_t exec;
    std::array<uintptr_t, 14> buffers;  ///< graph_buffers() when captured
  };
  std::map<graph_key, captured_graph> graphs_;
  std::set<graph_key> graphs_seen_;     ///< keys that ran once (captured at their second job)
  bool graphs_work_ = true;             ///< false after a capture failed
  std::atomic<uint64_t> replays_{0};    ///< jobs run as a graph launch

  device_buffer kv_dev_, inv_freq_, embed_, lm_head_, final_norm_;
  std::vector<device_layer> layers_;
  device_buffer x_, hn_, qkv_, attn_, gu_, act_, logits_dev_, tokens_dev_, args_dev_, partial_;
  device_buffer staging_up_[2], staging_send_[2];
  std::unique_ptr<cuda::deepseek_path> ds_;  ///< MLA and MoE layers (DeepSeek); null for Llama-family models
  pinned_buffer args_host_, logits_host_, tokens_host_;

  mutable std::mutex timeline_mutex_;
  std::vector<stream_span> timeline_;

  job_queue jobs_;  ///< last: its thread stops before the rest goes
};

}  // namespace

std::unique_ptr<executor> make_cuda_executor(model_config cfg, std::shared_ptr<const model_weights> weights,
                                             cuda_executor_config exec_cfg, std::string* why) {
  if (cfg.rope_scaling.type == "yarn" && !cfg.is_mla()) {  // MLA's kernels apply YaRN's factor; qkv_finish does not yet
    *why = "model " + cfg.name + " uses YaRN RoPE without latent attention, which only the CPU executor applies so far";
    return nullptr;
  }
  auto e = std::make_unique<cuda_executor>(std::move(cfg), std::move(weights), exec_cfg);
  if (auto err = e->init(); !err.empty()) {
    *why = std::move(err);
    return nullptr;
  }
  return e;
}

}  // namespace baton::gpu
