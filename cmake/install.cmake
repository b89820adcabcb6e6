# cmake --install: the library, the public headers under <prefix>/include/weave, a CMake package
# (find_package(weave) -> weave::weave) and a pkg-config file. A consumer gets every include
# path, flag and dependency weave needs, and none of its build-machine flags (-march).
include(CMakePackageConfigHelpers)

install(TARGETS weave EXPORT weaveTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# The public headers: weave/weave.h and every weave header it includes, transitively. The rest
# (kernels, backends, the communication runtime, the flat-buffer layer) stay inside the build.
# Configuration re-runs when one of them changes, so a new #include is installed too.
# The headers left at weave/parallel/*.h and four at weave/data/ only forward to their new
# places for one release (docs/design.md); they are installed so that code including the old
# paths still builds.
function(weave_public_headers out)
  file(GLOB forwarding RELATIVE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/weave/parallel/*.h)
  list(APPEND forwarding weave/data/tokenizer.h weave/data/pretokenizer.h
       weave/data/token_dataset.h weave/data/hf_checkpoint.h)
  # weave/util/cli.h is public too, outside weave.h: it needs CLI11, which only its users need.
  set(pending weave/weave.h weave/util/cli.h ${forwarding})
  set(found)
  while(pending)
    list(POP_FRONT pending header)
    if(header IN_LIST found)
      continue()
    endif()
    list(APPEND found ${header})
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/${header})
    file(STRINGS ${PROJECT_SOURCE_DIR}/${header} lines REGEX "^#include \"weave/")
    foreach(line IN LISTS lines)
      string(REGEX REPLACE "^#include \"(weave/[^\"]+)\".*" "\\1" included "${line}")
      list(APPEND pending ${included})
    endforeach()
  endwhile()
  set(${out} ${found} PARENT_SCOPE)
endfunction()
weave_public_headers(WEAVE_PUBLIC_HEADERS)
foreach(header IN LISTS WEAVE_PUBLIC_HEADERS)
  get_filename_component(folder ${header} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${folder})
endforeach()

set(WEAVE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/weave)
install(EXPORT weaveTargets NAMESPACE weave:: DESTINATION ${WEAVE_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/weaveConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/weaveConfig.cmake
                              INSTALL_DESTINATION ${WEAVE_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/weaveConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/weaveConfig.cmake ${PROJECT_BINARY_DIR}/weaveConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake
        DESTINATION ${WEAVE_CMAKE_DIR})

# pkg-config: static archive, so the dependencies' libraries go on Libs as well.
set(WEAVE_PC_REQUIRES "fmt")
set(WEAVE_PC_REQUIRES_PRIVATE "zlib")
if(WEAVE_WITH_OPENBLAS)
  string(APPEND WEAVE_PC_REQUIRES_PRIVATE " openblas")
endif()
set(WEAVE_PC_LIBS_PRIVATE "${OpenMP_CXX_FLAGS}")
if(WEAVE_WITH_DNNL)  # no pkg-config file of its own
  get_filename_component(WEAVE_DNNL_DIR "${WEAVE_DNNL_LIBRARY}" DIRECTORY)
  string(APPEND WEAVE_PC_LIBS_PRIVATE " -L${WEAVE_DNNL_DIR} -ldnnl")
endif()
if(WEAVE_LIBMVEC)
  string(APPEND WEAVE_PC_LIBS_PRIVATE " -lmvec")
endif()
if(WEAVE_WITH_MPI)
  string(APPEND WEAVE_PC_REQUIRES_PRIVATE " ompi-cxx")
endif()
if(WEAVE_WITH_CUDA)
  string(APPEND WEAVE_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcublas -lcudart")
endif()
if(WEAVE_WITH_CUDNN)
  get_filename_component(WEAVE_CUDNN_DIR "${WEAVE_CUDNN_LIBRARY}" DIRECTORY)
  string(APPEND WEAVE_PC_LIBS_PRIVATE " -L${WEAVE_CUDNN_DIR} -lcudnn")
endif()
if(WEAVE_WITH_NCCL)
  get_filename_component(WEAVE_NCCL_DIR "${NCCL_LIBRARY}" DIRECTORY)
  string(APPEND WEAVE_PC_LIBS_PRIVATE " -L${WEAVE_NCCL_DIR} -lnccl")
endif()
# From <prefix>/<libdir>/pkgconfig back up to <prefix> (libdir may be lib/x86_64-linux-gnu).
file(RELATIVE_PATH WEAVE_PC_UP "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
string(REGEX REPLACE "/$" "" WEAVE_PC_UP "${WEAVE_PC_UP}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/weave.pc.in ${PROJECT_BINARY_DIR}/weave.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/weave.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
