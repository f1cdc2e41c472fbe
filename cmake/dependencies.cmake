# Every dependency comes from Debian packages (scripts/setup.sh) except CUDA, which is optional.

find_package(Threads REQUIRED)
find_package(nlohmann_json 3.11 REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)  # tokenizer pre-split patterns
pkg_check_modules(ICU_UC REQUIRED IMPORTED_TARGET icu-uc)       # tokenizers' NFC normalizer (Qwen's)
find_package(ucx REQUIRED)  # UCX 1.13.1: ucx::ucp

# CAF 0.17.6: Debian ships no CMake config and no .pc file, so we import it by hand.
find_path(CAF_INCLUDE_DIR caf/all.hpp REQUIRED)
find_library(CAF_CORE_LIBRARY NAMES caf_core REQUIRED)
find_library(CAF_IO_LIBRARY NAMES caf_io REQUIRED)
add_library(caf_core_imp INTERFACE)
target_include_directories(caf_core_imp SYSTEM INTERFACE ${CAF_INCLUDE_DIR})
target_link_libraries(caf_core_imp INTERFACE ${CAF_CORE_LIBRARY} Threads::Threads)
add_library(CAF::core ALIAS caf_core_imp)
add_library(caf_io_imp INTERFACE)
target_link_libraries(caf_io_imp INTERFACE ${CAF_IO_LIBRARY} CAF::core)
add_library(CAF::io ALIAS caf_io_imp)
# CAF's OpenSSL module: mutual TLS between Baton's processes (deploy/net_security.hpp).
find_library(CAF_OPENSSL_LIBRARY NAMES caf_openssl REQUIRED)
find_package(OpenSSL REQUIRED)  # libssl-dev: the error-queue workaround (client/openssl_error_queue.cpp)
add_library(caf_openssl_imp INTERFACE)
target_link_libraries(caf_openssl_imp INTERFACE ${CAF_OPENSSL_LIBRARY} CAF::io)
add_library(CAF::openssl ALIAS caf_openssl_imp)

# OpenBLAS only for the sgemm ceiling in bench/; the executor never calls it.
find_library(OPENBLAS_LIBRARY NAMES openblas)
find_path(CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas)

# CUDA: optional, exactly as platform-notes §3. The CPU backend is always built.
option(WITH_CUDA "Build CUDA kernels if a CUDA compiler is found" ON)
set(HAVE_CUDA OFF)
if(WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)  # CMake 3.25 lacks these for nvcc
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(HAVE_CUDA ON)
  endif()
endif()
message(STATUS "baton: CUDA backend ${HAVE_CUDA}")
# NCCL (the transport's GPU-to-GPU backend): where CUDA is and NCCL's header and library are found
# beside it (/usr/local/cuda ships NCCL 2.28 here; the H200 machine has its own in /usr/lib).
set(HAVE_NCCL OFF)
if(HAVE_CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(HAVE_NCCL ON)
  endif()
endif()
message(STATUS "baton: NCCL transport ${HAVE_NCCL}")
