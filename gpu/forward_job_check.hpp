#pragma once

// Every executor's check of a job before it runs (check_forward_job, declared in executor.hpp),
// and the refusal of an executor that cannot pick after every row (speculative decoding).

#include <string>

#include "gpu/executor.hpp"

namespace baton::gpu {

/// For an executor whose picks_every_row() is false: the refusal of a job that asks for picks
/// after every row (forward_seq::row_samples), naming the sequence and `executor`; empty when
/// the job asks none.
std::string row_picks_refusal(const forward_job& job, const std::string& executor);

}  // namespace baton::gpu
