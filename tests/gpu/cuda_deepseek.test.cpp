// Conformance of DeepSeek's CUDA kernels (gpu/cuda/deepseek_kernels.hpp) with their CPU
// references: the latent's norm and rotation, the per-head products, latent attention, routing,
// and the grouped expert products with their combine. Label "gpu"; every case skips where no
// device is present. Written without a GPU; all passed on the H200 on 2026-12-04
// (docs/gpu-runs/). The executor end to end is in cuda_executor.test.cpp.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gpu/cpu_kernels.hpp"
#include "gpu/cuda/deepseek_kernels.hpp"
#include "gpu/model_config.hpp"
#include "gpu/moe_routing.hpp"
#include "tests/gpu/dev_vec.hpp"

using namespace baton;
using namespace baton::gpu;
using test::dev_vec;
using test::max_abs_diff;
using test::through_bf16;
using test::wavy;

namespace {

const bool no_gpu = cuda::device_count() == 0;

float max_abs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace

TEST_CASE("cuda mla_finish: the latent normalised and rotated into the KV slot, each head's RoPE query rotated into "
          "the latent query, as rmsnorm and rope_apply_interleaved (both rotations)" * doctest::skip(no_gpu)) {
  const uint32_t rows = 3, heads = 5, lora = 96, nope = 16, rope = 8, lat = lora + rope, qk = nope + rope;
  const auto kva = wavy(rows * lat, 0.37f, 0.2f, 2.0f), norm = wavy(lora, 0.1f, 1.0f, 0.5f);
  const auto q = wavy(rows * heads * qk, 0.21f, 0.7f);
  std::vector<float> inv_freq(rope / 2);
  for (uint32_t i = 0; i < rope / 2; ++i) inv_freq[i] = 1.0f / std::pow(10000.0f, 2.0f * i / rope);
  const std::vector<uint32_t> positions{0, 7, 300};
  const std::vector<uint64_t> slots{lat * 2, 0, lat * 5};  // the rows' latents anywhere in the layer
  for (bool interleave : {true, false}) {
    CAPTURE(interleave);
    dev_vec dkva{kva}, dnorm{norm}, dq{q}, dqlat{uint64_t{rows} * heads * lat * 4}, dfreq{inv_freq}, dpos{positions},
        dslot{slots}, dkv{uint64_t{8} * lat * 4};
    REQUIRE(cuda::launch_mla_finish({dkva.as<float>(), dnorm.as<float>(), dq.as<float>(), dqlat.as<float>(),
                                     dfreq.as<float>(), dpos.as<uint32_t>(), dslot.as<uint64_t>(), dkv.ptr, rows, heads,
                                     lora, nope, rope, 1e-6f, 1.25f, interleave, cuda::dtype::f32},
                                    nullptr) == 0);
    const auto kv = dkv.get<float>(8 * lat);
    const auto qlat = dqlat.get<float>(uint64_t{rows} * heads * lat);
    auto rotate = [&](float* x, uint32_t pos) {
      if (interleave)
        rope_apply_interleaved(x, rope, pos, inv_freq.data());
      else
        rope_apply(x, 1, rope, pos, inv_freq.data());
      for (uint32_t i = 0; i < rope; ++i) x[i] *= 1.25f;
    };
    float worst = 0;
    for (uint32_t r = 0; r < rows; ++r) {
      std::vector<float> want(kva.begin() + r * lat, kva.begin() + (r + 1) * lat);
      rmsnorm(want.data(), norm.data(), 1, lora, 1e-6f, want.data());
      rotate(want.data() + lora, positions[r]);
      const std::vector<float> got(kv.begin() + static_cast<long>(slots[r]), kv.begin() + static_cast<long>(slots[r] + lat));
      CHECK(std::equal(got.begin(), got.begin() + lora, want.begin()));  // the norm: bit for bit
      worst = std::max(worst, max_abs_diff(got, want));
      for (uint32_t h = 0; h < heads; ++h) {
        std::vector<float> qr(q.begin() + (r * heads + h) * qk + nope, q.begin() + (r * heads + h + 1) * qk);
        rotate(qr.data(), positions[r]);
        const float* g = qlat.data() + (uint64_t{r} * heads + h) * lat + lora;
        for (uint32_t i = 0; i < rope; ++i) worst = std::max(worst, std::abs(g[i] - qr[i]));
      }
    }
    CHECK(worst <= 1e-5f);  // cosf/sinf against std::cos/std::sin
  }
}

TEST_CASE("cuda head_gemv: per-head products equal the dot products, the same bits for a row in any tile, and bf16 "
          "weights and outputs round them" * doctest::skip(no_gpu)) {
  const uint32_t rows = 11, heads = 3, in = 40, out = 70;  // 11 rows: a full tile of 8 and a partial one
  const uint32_t xh = in + 5, xr = heads * xh + 3;          // strides wider than the data
  const auto x = wavy(rows * xr, 0.13f, 0.3f), w = wavy(heads * out * in, 0.071f, 0.9f, 0.2f);
  std::vector<float> want(rows * heads * out);
  for (uint32_t r = 0; r < rows; ++r)
    for (uint32_t h = 0; h < heads; ++h)
      for (uint32_t j = 0; j < out; ++j) {
        double acc = 0;
        for (uint32_t i = 0; i < in; ++i) acc += double{w[(h * out + j) * in + i]} * x[r * xr + h * xh + i];
        want[(r * heads + h) * out + j] = static_cast<float>(acc);
      }
  dev_vec dx{x}, dw{w}, dy{want.size() * 4};
  REQUIRE(cuda::launch_head_gemv({dx.as<float>(), xr, xh, dw.ptr, cuda::dtype::f32, dy.ptr, heads * out, out,
                                  cuda::dtype::f32, rows, heads, in, out},
                                 nullptr) == 0);
  const auto all = dy.get<float>(want.size());
  CHECK(max_abs_diff(all, want) <= 1e-5f * max_abs(want));
  // Row 9 alone (a tile of one) gives the bits it had in a tile of three.
  dev_vec dx1{std::vector<float>(x.begin() + 9 * xr, x.begin() + 10 * xr)}, dy1{heads * out * 4};
  REQUIRE(cuda::launch_head_gemv({dx1.as<float>(), xr, xh, dw.ptr, cuda::dtype::f32, dy1.ptr, heads * out, out,
                                  cuda::dtype::f32, 1, heads, in, out},
                                 nullptr) == 0);
  const auto one = dy1.get<float>(heads * out);
  CHECK(std::equal(one.begin(), one.end(), all.begin() + 9 * heads * out));
  // bf16 weights in, bf16 out: within bf16 rounding of the fp32 result over rounded weights.
  dev_vec wb{w.size() * 2}, yb{want.size() * 2}, yf{want.size() * 4};
  cuda::launch_convert({dw.ptr, cuda::dtype::f32, wb.ptr, cuda::dtype::bf16, w.size()}, nullptr);
  REQUIRE(cuda::launch_head_gemv({dx.as<float>(), xr, xh, wb.ptr, cuda::dtype::bf16, yb.ptr, heads * out, out,
                                  cuda::dtype::bf16, rows, heads, in, out},
                                 nullptr) == 0);
  cuda::launch_convert({yb.ptr, cuda::dtype::bf16, yf.ptr, cuda::dtype::f32, want.size()}, nullptr);
  CHECK(max_abs_diff(yf.get<float>(want.size()), want) <= 0.02f * max_abs(want));
}

TEST_CASE("cuda latent attention equals latent_attention_ref for every head of rows at many positions, heads not a "
          "multiple of a block's eight; split over position ranges, a row within the first range keeps its bits" * doctest::skip(no_gpu)) {
  const uint32_t heads = 12, lora = 64, rope = 16, lat = lora + rope, ps = 16, num_pages = 12;
  const uint64_t page_elems = uint64_t{ps} * lat;
  const auto kv = wavy(num_pages * page_elems, 0.013f, 0.4f);
  // Two sequences with their pages in no particular order; rows at positions across chunk edges.
  const std::vector<uint32_t> page_table{7, 2, 9, 0, 11, 4, 1, 3, 10, 8};  // seq 0: first 6, seq 1: last 4
  const std::vector<uint32_t> positions{0, 31, 32, 95, 5, 63};
  const std::vector<uint32_t> row_pages{0, 0, 0, 0, 6, 6};
  const uint32_t rows = static_cast<uint32_t>(positions.size());
  const auto q = wavy(rows * heads * lat, 0.29f, 0.1f, 0.3f);
  const float scale = 0.11f;
  dev_vec dq{q}, dkv{kv}, dpos{positions}, dtable{page_table}, drp{row_pages}, dout{uint64_t{rows} * heads * lora * 4};
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    const auto kv_in = bf16 ? through_bf16(kv) : kv;
    dev_vec dkvb{kv.size() * 2};
    cuda::launch_convert({dkv.ptr, cuda::dtype::f32, dkvb.ptr, cuda::dtype::bf16, kv.size()}, nullptr);
    REQUIRE(cuda::launch_latent_attention({dq.as<float>(), bf16 ? dkvb.ptr : dkv.ptr, dpos.as<uint32_t>(),
                                           dtable.as<uint32_t>(), drp.as<uint32_t>(), dout.as<float>(), rows, heads, lora,
                                           rope, ps, page_elems, scale, bf16 ? cuda::dtype::bf16 : cuda::dtype::f32},
                                          nullptr) == 0);
    const auto got = dout.get<float>(uint64_t{rows} * heads * lora);
    float worst = 0;
    for (uint32_t r = 0; r < rows; ++r)
      for (uint32_t h = 0; h < heads; ++h) {
        std::vector<float> scores(positions[r] + 1), want(lora);
        latent_attention_ref(q.data() + (r * heads + h) * lat, positions[r] + 1, kv_in.data(),
                             page_table.data() + row_pages[r], ps, lat, page_elems, lora, scale, scores.data(),
                             want.data());
        for (uint32_t d = 0; d < lora; ++d) worst = std::max(worst, std::abs(got[(r * heads + h) * lora + d] - want[d]));
      }
    MESSAGE("latent attention, bf16 " << bf16 << ": max |diff| " << worst);
    CHECK(worst <= 1e-5f);  // the same inputs (bf16 KV rounded for the reference too), fp32 sums
    // Split into ranges of 64 positions (a long decode's grid): rows within the first range give
    // the unsplit bits; the row at 95 spans two ranges and is merged.
    dev_vec split_out{uint64_t{rows} * heads * lora * 4}, partial{uint64_t{2} * rows * heads * (lora + 2) * 4};
    cuda::latent_attention_params sp{dq.as<float>(), bf16 ? dkvb.ptr : dkv.ptr, dpos.as<uint32_t>(), dtable.as<uint32_t>(),
                                     drp.as<uint32_t>(), split_out.as<float>(), rows, heads, lora, rope, ps, page_elems,
                                     scale, bf16 ? cuda::dtype::bf16 : cuda::dtype::f32, 2, 64, partial.as<float>()};
    REQUIRE(cuda::launch_latent_attention(sp, nullptr) == 0);
    const auto split = split_out.get<float>(uint64_t{rows} * heads * lora);
    for (uint32_t r = 0; r < rows; ++r) {
      CAPTURE(r);
      const auto first = got.begin() + r * heads * lora, last = first + heads * lora;
      if (positions[r] < 64)
        CHECK(std::equal(first, last, split.begin() + r * heads * lora));
      else
        CHECK(max_abs_diff(std::vector<float>(first, last),
                           std::vector<float>(split.begin() + r * heads * lora, split.begin() + (r + 1) * heads * lora)) <=
              1e-5f);
    }
  }
}

namespace {

/// Router logits with distinct values, so no tie decides a choice.
std::vector<float> router_logits(uint32_t rows, uint32_t experts) {
  auto v = wavy(rows * experts, 0.917f, 0.3f, 3.0f);
  for (size_t i = 0; i < v.size(); ++i) v[i] += 1e-4f * static_cast<float>(i % experts);
  return v;
}

}  // namespace

TEST_CASE("cuda moe_route picks moe_route's experts with its weights for V2's and V3's gating" * doctest::skip(no_gpu)) {
  const uint32_t rows = 70;
  for (bool v3 : {false, true}) {
    for (const char* method : {"greedy", "group_limited_greedy", "noaux_tc"}) {
      auto m = deepseek_tiny_config(v3).moe;
      m.n_routed_experts = 64;
      m.num_experts_per_tok = 6;
      m.n_group = 8;
      m.topk_group = 3;
      m.topk_method = method;
      CAPTURE(v3);
      CAPTURE(method);
      const uint32_t E = m.n_routed_experts, k = m.num_experts_per_tok;
      const auto logits = router_logits(rows, E);
      const auto bias = wavy(E, 0.5f, 0.0f, 0.05f);
      dev_vec dl{logits}, db{bias}, dc{rows * k * 4}, dw{rows * k * 4};
      REQUIRE(cuda::launch_moe_route({dl.as<float>(), db.as<float>(), dc.as<uint32_t>(), dw.as<float>(), rows, E, k,
                                      m.n_group, m.topk_group, m.scoring == "sigmoid",
                                      m.topk_method == "greedy" ? 0u : m.topk_method == "noaux_tc" ? 2u : 1u,
                                      m.norm_topk_prob, m.routed_scaling_factor},
                                     nullptr) == 0);
      const auto chosen = dc.get<uint32_t>(rows * k);
      const auto weight = dw.get<float>(rows * k);
      std::vector<uint32_t> want_c(k);
      std::vector<float> want_w(k), scratch(2 * E + m.n_group);
      uint32_t same = 0;
      float worst = 0;
      for (uint32_t r = 0; r < rows; ++r) {
        moe_route(m, logits.data() + r * E, bias.data(), want_c.data(), want_w.data(), scratch.data());
        same += std::equal(want_c.begin(), want_c.end(), chosen.begin() + r * k);
        for (uint32_t j = 0; j < k; ++j) worst = std::max(worst, std::abs(weight[r * k + j] - want_w[j]));
      }
      CHECK(same == rows);
      CHECK(worst <= 1e-6f * std::max(1.0f, m.routed_scaling_factor));
    }
  }
}

TEST_CASE("cuda MoE plan, grouped products and combine equal the CPU executor's routed sum, and a row's output does "
          "not depend on the other rows bound for its experts" * doctest::skip(no_gpu)) {
  // 150 rows x top-3 over 5 experts: some experts get more than a 64-row tile, one gets none.
  const uint32_t rows = 150, E = 5, k = 3, h = 24, f = 20;
  std::vector<uint32_t> chosen(rows * k);
  std::vector<float> weight(rows * k);
  for (uint32_t r = 0; r < rows; ++r) {
    const uint32_t a = r % 4, b = (r / 4) % 4;  // expert 4 is never chosen
    std::vector<uint32_t> c{a, b == a ? (a + 1) % 4 : b};
    c.push_back(0);
    for (uint32_t x = 0; x < 4; ++x)
      if (std::find(c.begin(), c.begin() + 2, x) == c.begin() + 2) {
        c[2] = x;
        break;
      }
    std::sort(c.begin(), c.end());
    for (uint32_t j = 0; j < k; ++j) {
      chosen[r * k + j] = c[j];
      weight[r * k + j] = 0.2f + 0.1f * static_cast<float>((r + j) % 5);
    }
  }
  const auto x0 = wavy(rows * h, 0.17f, 0.2f), hn = wavy(rows * h, 0.23f, 0.5f);
  const auto gu = wavy(E * 2 * f * h, 0.041f, 0.3f, 0.3f), down = wavy(E * h * f, 0.057f, 0.8f, 0.3f);
  const auto shared = wavy(rows * h, 0.31f, 0.9f, 0.1f);
  // The CPU executor's order: per expert its rows' SwiGLU MLP, each row summing its experts in
  // ascending order from zero, then the shared output, then the residual.
  std::vector<float> want = x0;
  for (uint32_t r = 0; r < rows; ++r) {
    std::vector<float> proj(h, 0.0f), g(f), u(f), a(f), y(h);
    for (uint32_t j = 0; j < k; ++j) {
      const uint32_t e = chosen[r * k + j];
      matmul_nt(hn.data() + r * h, 1, h, gu.data() + e * 2 * f * h, f, g.data(), nullptr);
      matmul_nt(hn.data() + r * h, 1, h, gu.data() + e * 2 * f * h + f * h, f, u.data(), nullptr);
      swiglu(g.data(), u.data(), f, a.data());
      matmul_nt(a.data(), 1, f, down.data() + e * h * f, h, y.data(), nullptr);
      for (uint32_t d = 0; d < h; ++d) proj[d] += weight[r * k + j] * y[d];
    }
    for (uint32_t d = 0; d < h; ++d) want[r * h + d] += proj[d] + shared[r * h + d];
  }
  auto run = [&](uint32_t first, uint32_t n) {  // rows [first, first + n) alone
    const uint32_t pairs = n * k, tiles = cuda::moe_max_tiles(pairs, E);
    dev_vec dc{std::vector<uint32_t>(chosen.begin() + first * k, chosen.begin() + (first + n) * k)},
        dw{std::vector<float>(weight.begin() + first * k, weight.begin() + (first + n) * k)},
        dx{std::vector<float>(x0.begin() + first * h, x0.begin() + (first + n) * h)},
        dh{std::vector<float>(hn.begin() + first * h, hn.begin() + (first + n) * h)},
        dsh{std::vector<float>(shared.begin() + first * h, shared.begin() + (first + n) * h)}, dgu{gu}, ddown{down},
        slot{pairs * 4}, slot_row{pairs * 4}, offsets{(E + 1) * 4}, te{tiles * 4}, tf{tiles * 4}, nt{4},
        y1{uint64_t{pairs} * 2 * f * 4}, act{uint64_t{pairs} * f * 4}, y2{uint64_t{pairs} * h * 4};
    REQUIRE(cuda::launch_moe_plan({dc.as<uint32_t>(), n, k, E, slot.as<uint32_t>(), slot_row.as<uint32_t>(),
                                   offsets.as<uint32_t>(), te.as<uint32_t>(), tf.as<uint32_t>(), nt.as<uint32_t>()},
                                  nullptr) == 0);
    cuda::grouped_gemm_params p{dh.ptr, h, slot_row.as<uint32_t>(), dgu.ptr, y1.as<float>(), offsets.as<uint32_t>(),
                                te.as<uint32_t>(), tf.as<uint32_t>(), nt.as<uint32_t>(), tiles, 2 * f, h,
                                cuda::dtype::f32};
    REQUIRE(cuda::launch_grouped_gemm(p, nullptr) == 0);
    REQUIRE(cuda::launch_swiglu({y1.as<float>(), act.ptr, pairs, f, cuda::dtype::f32}, nullptr) == 0);
    p.a = act.ptr;
    p.a_stride = f;
    p.a_rows = nullptr;
    p.w = ddown.ptr;
    p.y = y2.as<float>();
    p.n = h;
    p.k = f;
    REQUIRE(cuda::launch_grouped_gemm(p, nullptr) == 0);
    REQUIRE(cuda::launch_moe_combine({dx.as<float>(), y2.as<float>(), slot.as<uint32_t>(), dw.as<float>(),
                                      dsh.as<float>(), n, k, h},
                                     nullptr) == 0);
    const auto off = offsets.get<uint32_t>(E + 1);
    if (n == rows) {  // the plan itself: expert e's pairs in row order, none for expert 4
      CHECK(off[E] == pairs);
      CHECK(off[4] == off[5]);
      const auto rows_of = slot_row.get<uint32_t>(pairs);
      for (uint32_t e = 0; e < E; ++e)
        CHECK(std::is_sorted(rows_of.begin() + off[e], rows_of.begin() + off[e + 1]));
      uint32_t want_tiles = 0;
      for (uint32_t e = 0; e < E; ++e) want_tiles += (off[e + 1] - off[e] + cuda::moe_tile_rows - 1) / cuda::moe_tile_rows;
      CHECK(nt.get<uint32_t>(1)[0] == want_tiles);
    }
    return dx.get<float>(uint64_t{n} * h);
  };
  const auto all = run(0, rows);
  CHECK(max_abs_diff(all, want) <= 1e-5f * max_abs(want));
  const auto alone = run(77, 2);  // rows 77 and 78 without the other 148
  CHECK(std::equal(alone.begin(), alone.end(), all.begin() + 77 * h));
}

TEST_CASE("cuda grouped products: an expert's few rows (the column-per-thread path) get the bits they get in a full "
          "tile, in fp32 and bf16, with k past one staging chunk and not a multiple of 16; so do they on the tensor "
          "cores (bf16)" *
          doctest::skip(no_gpu)) {
  const uint32_t E = 2, rows = 20, h = 328, n = 140;  // k = 328: two chunks of 256, 16-byte vectors, padding to 336
  std::vector<uint32_t> chosen(rows);
  for (uint32_t r = 0; r < rows; ++r) chosen[r] = r % 5 == 0 ? 0 : 1;  // expert 1: 16 rows (a tile); expert 0: 4
  const auto x = wavy(rows * h, 0.19f, 0.4f), w = wavy(E * n * h, 0.037f, 0.6f, 0.2f);
  for (const auto& [bf16, tc] : {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
    CAPTURE(bf16);
    CAPTURE(tc);
    const auto t = bf16 ? cuda::dtype::bf16 : cuda::dtype::f32;
    const uint32_t tb = bf16 ? 2 : 4;
    dev_vec xf{x}, wf{w}, xd{x.size() * tb}, wd{w.size() * tb};
    cuda::launch_convert({xf.ptr, cuda::dtype::f32, xd.ptr, t, x.size()}, nullptr);
    cuda::launch_convert({wf.ptr, cuda::dtype::f32, wd.ptr, t, w.size()}, nullptr);
    // Rows [first, first + count) through the plan and the gate|up product; each row's output.
    auto run = [&](uint32_t first, uint32_t count) {
      const uint32_t tiles = cuda::moe_max_tiles(count, E);
      dev_vec dc{std::vector<uint32_t>(chosen.begin() + first, chosen.begin() + first + count)}, slot{count * 4},
          slot_row{count * 4}, offsets{(E + 1) * 4}, te{tiles * 4}, tf{tiles * 4}, nt{4}, y{uint64_t{count} * n * 4};
      REQUIRE(cuda::launch_moe_plan({dc.as<uint32_t>(), count, 1, E, slot.as<uint32_t>(), slot_row.as<uint32_t>(),
                                     offsets.as<uint32_t>(), te.as<uint32_t>(), tf.as<uint32_t>(), nt.as<uint32_t>()},
                                    nullptr) == 0);
      const char* a = static_cast<const char*>(xd.ptr) + uint64_t{first} * h * tb;
      const cuda::grouped_gemm_params gp{a, h, slot_row.as<uint32_t>(), wd.ptr, y.as<float>(), offsets.as<uint32_t>(),
                                         te.as<uint32_t>(), tf.as<uint32_t>(), nt.as<uint32_t>(), tiles, n, h, t, tc};
      REQUIRE(cuda::grouped_gemm_on_tensor_cores(gp) == tc);  // k = 328 and bf16: the tensor cores take it
      REQUIRE(cuda::launch_grouped_gemm(gp, nullptr) == 0);
      const auto slots = slot.get<uint32_t>(count);
      const auto out = y.get<float>(uint64_t{count} * n);
      std::vector<std::vector<float>> by_row(count);
      for (uint32_t r = 0; r < count; ++r) by_row[r].assign(out.begin() + slots[r] * n, out.begin() + (slots[r] + 1) * n);
      return by_row;
    };
    const auto all = run(0, rows);  // expert 1's 16 rows: the tiled path; expert 0's 4: the thin one
    const auto few = run(6, 7);     // rows 6..12: 1 row of expert 0 and 6 of expert 1, all thin
    for (uint32_t r = 0; r < 7; ++r) CHECK_MESSAGE(std::equal(few[r].begin(), few[r].end(), all[6 + r].begin()), "row " << 6 + r);
    const auto xr = bf16 ? through_bf16(x) : x, wr = bf16 ? through_bf16(w) : w;
    float worst = 0, top = 0;
    for (uint32_t r = 0; r < rows; ++r) {
      std::vector<float> want(n);
      matmul_nt(xr.data() + r * h, 1, h, wr.data() + uint64_t{chosen[r]} * n * h, n, want.data(), nullptr);
      worst = std::max(worst, max_abs_diff(all[r], want));
      top = std::max(top, max_abs(want));
    }
    // The same rounded inputs, fp32 sums in another order (the tensor cores' partial sums round
    // toward zero: a looser bound).
    CHECK(worst <= (tc ? 1e-4f : 1e-5f) * top);
  }
}
