/* nvfp4moe/version.h: the version of these headers (the crate's, Cargo.toml; CMake's project
 * version is read from here, and a test checks the crate's). nvfp4moe::version() returns the
 * library's, so a program can check that the headers it compiled with match the library it runs
 * with. C99 and C++. */
#ifndef NVFP4MOE_VERSION_H_
#define NVFP4MOE_VERSION_H_

#define NVFP4MOE_VERSION_MAJOR 0
#define NVFP4MOE_VERSION_MINOR 2
#define NVFP4MOE_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH. */
#define NVFP4MOE_VERSION (NVFP4MOE_VERSION_MAJOR * 10000 + NVFP4MOE_VERSION_MINOR * 100 + NVFP4MOE_VERSION_PATCH)

#endif /* NVFP4MOE_VERSION_H_ */
