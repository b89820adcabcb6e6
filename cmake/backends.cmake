# Finds what the optional backends need and turns each WEAVE_WITH_* off, with a note, where it
# is missing; weave/'s folders then choose between a backend's sources and its no_*.cpp stub.

if(WEAVE_WITH_OPENBLAS)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(OPENBLAS QUIET openblas)
  endif()
  find_library(WEAVE_OPENBLAS_LIBRARY NAMES openblas HINTS ${OPENBLAS_LIBRARY_DIRS})
  find_path(WEAVE_OPENBLAS_INCLUDE_DIR cblas.h HINTS ${OPENBLAS_INCLUDE_DIRS}
            PATH_SUFFIXES openblas-pthread openblas)
  if(NOT (WEAVE_OPENBLAS_LIBRARY AND WEAVE_OPENBLAS_INCLUDE_DIR))
    message(STATUS "weave: OpenBLAS not found (libopenblas-pthread-dev); GEMM through Eigen")
    set(WEAVE_WITH_OPENBLAS OFF)
  endif()
endif()

if(WEAVE_WITH_DNNL)
  find_library(WEAVE_DNNL_LIBRARY NAMES dnnl)
  find_path(WEAVE_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
  if(NOT (WEAVE_DNNL_LIBRARY AND WEAVE_DNNL_INCLUDE_DIR))
    message(STATUS "weave: oneDNN not found (libdnnl-dev); bfloat16/float16 GEMM in float32")
    set(WEAVE_WITH_DNNL OFF)
  endif()
endif()

# glibc's vector math (libmvec) vectorizes exp, log, tanh & co. in the CPU elementwise loops.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  find_library(WEAVE_LIBMVEC NAMES mvec)
endif()

if(WEAVE_WITH_MPI)
  find_package(MPI COMPONENTS CXX)
  if(NOT MPI_CXX_FOUND)
    message(WARNING "MPI not found (apt-get install libopenmpi-dev openmpi-bin); building without it")
    set(WEAVE_WITH_MPI OFF)
  endif()
endif()

if(WEAVE_WITH_CUDA)
  # sm_90 (H100/H200) by default; "native" needs a GPU at configure time.
  set(WEAVE_CUDA_ARCHITECTURES "90" CACHE STRING "CUDA architectures to compile for")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  set(CMAKE_CUDA_ARCHITECTURES ${WEAVE_CUDA_ARCHITECTURES})
  enable_language(CUDA)
  # CUDA sources are C++17: fmt 9 does not compile under nvcc's C++20 mode (fmtlib/fmt#3543),
  # so the headers they include (tensor/, kernels/) stay C++17-clean.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  set_target_properties(weave PROPERTIES CUDA_ARCHITECTURES "${WEAVE_CUDA_ARCHITECTURES}"
                                         CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  target_link_libraries(weave PRIVATE CUDA::cudart CUDA::cublas)
  target_compile_options(weave PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xcompiler=-fopenmp>)
endif()

if(WEAVE_WITH_CUDNN AND WEAVE_WITH_CUDA)
  find_path(WEAVE_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(WEAVE_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  if(NOT (WEAVE_CUDNN_INCLUDE_DIR AND WEAVE_CUDNN_LIBRARY))
    message(STATUS "weave: cuDNN not found; attention on weave's own tensor-core kernels only")
    set(WEAVE_WITH_CUDNN OFF)
  endif()
else()
  set(WEAVE_WITH_CUDNN OFF)
endif()

if(WEAVE_WITH_NCCL AND WEAVE_WITH_CUDA)
  find_package(NCCL)
  if(NOT NCCL_FOUND)
    message(WARNING "NCCL not found under /usr/local/cuda; building without it")
    set(WEAVE_WITH_NCCL OFF)
  endif()
else()
  set(WEAVE_WITH_NCCL OFF)
endif()
