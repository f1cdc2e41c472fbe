#pragma once

// Floats that cross processes travel as their bit patterns.
//
// CAF 0.17's binary serializer packs a float by hand (caf/detail/ieee_754.hpp, pack754): NaN
// arrives as 1.0, and an infinity never leaves the loop that normalises it, so the sending
// thread hangs for good (tried here: pack754(-inf) did not return). Model outputs can be
// non-finite (a log-probability of -inf for a token that cannot be picked, an overflowing
// logit), and a client may send any number. So every float of a message type is inspected
// through these wrappers, in its type's inspect: the bits go as an integer and come back exact.
//
//   return f(caf::meta::type_name("x"), wire::f32{&x.temperature}, wire::f32s{&x.logits});

#include <cstdint>
#include <cstring>
#include <vector>

#include <caf/error.hpp>
#include <caf/meta/load_callback.hpp>

namespace baton::wire {

struct f32 {
  float* value;
};
struct f64 {
  double* value;
};
struct f32s {
  std::vector<float>* values;
};
struct f32_rows {
  std::vector<std::vector<float>>* rows;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, f32& x) {
  uint32_t bits = 0;
  std::memcpy(&bits, x.value, sizeof bits);
  return f(bits, caf::meta::load_callback([&]() -> caf::error {
             std::memcpy(x.value, &bits, sizeof bits);
             return caf::none;
           }));
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, f64& x) {
  uint64_t bits = 0;
  std::memcpy(&bits, x.value, sizeof bits);
  return f(bits, caf::meta::load_callback([&]() -> caf::error {
             std::memcpy(x.value, &bits, sizeof bits);
             return caf::none;
           }));
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, f32s& x) {
  std::vector<uint32_t> bits(x.values->size());
  if (!bits.empty()) std::memcpy(bits.data(), x.values->data(), bits.size() * sizeof(float));
  return f(bits, caf::meta::load_callback([&]() -> caf::error {
             x.values->resize(bits.size());
             if (!bits.empty()) std::memcpy(x.values->data(), bits.data(), bits.size() * sizeof(float));
             return caf::none;
           }));
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, f32_rows& x) {
  std::vector<std::vector<uint32_t>> bits(x.rows->size());
  for (size_t i = 0; i < bits.size(); ++i) {
    bits[i].resize((*x.rows)[i].size());
    if (!bits[i].empty()) std::memcpy(bits[i].data(), (*x.rows)[i].data(), bits[i].size() * sizeof(float));
  }
  return f(bits, caf::meta::load_callback([&]() -> caf::error {
             x.rows->resize(bits.size());
             for (size_t i = 0; i < bits.size(); ++i) {
               (*x.rows)[i].resize(bits[i].size());
               if (!bits[i].empty()) std::memcpy((*x.rows)[i].data(), bits[i].data(), bits[i].size() * sizeof(float));
             }
             return caf::none;
           }));
}

}  // namespace baton::wire
