/* nvfp4moe/export.h: NVFP4MOE_API marks the functions the shared library exports.
 *
 * The core is compiled with hidden visibility (-fvisibility=hidden): only what carries this
 * attribute is visible outside libnvfp4moe.so (CUTLASS, CuTe and the kernels are not). The static
 * library's objects are the same; the attribute changes nothing for a static link. C99 and C++. */
#ifndef NVFP4MOE_EXPORT_H_
#define NVFP4MOE_EXPORT_H_

#if defined(_WIN32)
#define NVFP4MOE_API
#else
#define NVFP4MOE_API __attribute__((visibility("default")))
#endif

#endif /* NVFP4MOE_EXPORT_H_ */
