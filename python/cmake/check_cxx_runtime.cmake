# cmake -DLIB=<library> -DCXX=<compiler> [-DCMAKE_OBJDUMP=<objdump>] -P check_cxx_runtime.cmake
#
# (file(GET_RUNTIME_DEPENDENCIES) reads the library's dependencies with binutils' objdump.)
#
# The operator library must load the shared C++ runtime (libstdc++.so.6), the one PyTorch's
# libraries use. A toolchain that links libstdc++ into shared libraries statically gives the
# operator a second copy of it beside PyTorch's: objects of one (locales, streams) then reach code
# of the other, and formatting a number into an error message crashed the interpreter (SIGSEGV,
# /opt/gcc/bin/g++ on the H100 machine, 2026-12-06). Fail the build with the fix instead.
file(GET_RUNTIME_DEPENDENCIES
  LIBRARIES "${LIB}"
  RESOLVED_DEPENDENCIES_VAR resolved
  UNRESOLVED_DEPENDENCIES_VAR unresolved
  PRE_INCLUDE_REGEXES "^libstdc\\+\\+\\.so"
  PRE_EXCLUDE_REGEXES ".*")
if(NOT resolved AND NOT unresolved)
  message(FATAL_ERROR
    # (The first word is one token for scripts to find: CMake wraps the lines of the message.)
    "NVFP4MOE_STATIC_LIBSTDCXX: ${LIB} does not load the shared C++ runtime (libstdc++.so.6): the C++ "
    "compiler ${CXX} links it "
    "statically into shared libraries, so the operator would carry a second C++ runtime beside "
    "PyTorch's and crash the interpreter. Build with a compiler that links libstdc++ dynamically, "
    "e.g. CXX=/usr/bin/g++ pip install ./python")
endif()
