#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang, ASan and UBSan into build-fuzz/, then runs each
# for SECONDS (default 30) from its seed corpus (fuzz/corpus/<target>/; new inputs go to a
# temporary folder, not the repository). Fails when any target finds a crash, and leaves the
# crashing input in build-fuzz/crashes/. Skips, saying so, where clang or libFuzzer is missing.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-30}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(http openai tool_calls json_schema cluster_spec api_keys trace hf_config tokenizer chat_template safetensors block_file)
if ! command -v clang++ > /dev/null; then echo "fuzz: SKIPPED: no clang++ (Debian: clang, libclang-rt-dev)"; exit 0; fi
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
     clang++ -x c++ -fsanitize=fuzzer - -o /tmp/baton-fuzz-probe 2> /dev/null; then
  echo "fuzz: SKIPPED: clang++ cannot link libFuzzer (Debian: libclang-rt-14-dev)"; exit 0
fi
rm -f /tmp/baton-fuzz-probe
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DBATON_FUZZ=ON -DWITH_CUDA=OFF -DBUILD_TESTING=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
cmake --build build-fuzz -j "${BATON_JOBS:-2}" --target $(printf "fuzz_%s " "${TARGETS[@]}") > build-fuzz/build.log 2>&1 ||
  { tail -30 build-fuzz/build.log; exit 1; }
mkdir -p build-fuzz/crashes
failed=0
for t in "${TARGETS[@]}"; do
  work=$(mktemp -d /tmp/baton-fuzz-$t-XXXXXX)
  # A fixed seed (BATON_FUZZ_SEED, default 1) so that a CI run explores the same way each time;
  # pass another to explore further by hand.
  if build-fuzz/fuzz/fuzz_$t -seed="${BATON_FUZZ_SEED:-1}" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
       -artifact_prefix=build-fuzz/crashes/$t- -print_final_stats=1 "$work" "fuzz/corpus/$t" > "build-fuzz/$t.log" 2>&1; then
    echo "fuzz: $t: clean for ${SECONDS_EACH} s ($(grep -o 'stat::number_of_executed_units: [0-9]*' "build-fuzz/$t.log" | grep -o '[0-9]*$') runs)"
  else
    echo "fuzz: $t: FOUND A CRASH (build-fuzz/crashes/$t-*; log build-fuzz/$t.log)"
    grep -m5 -E "ERROR|SUMMARY|runtime error" "build-fuzz/$t.log" || true
    failed=1
  fi
  rm -rf "$work"
done
exit $failed
