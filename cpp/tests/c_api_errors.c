/* GPU-free tests of the C ABI, compiled as C99 (ctest): argument errors are a status and a
 * message, never a crash; the version and the status strings. */
#include "nvfp4moe/nvfp4moe_c.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

static void expect_status(nvfp4moe_Status got, nvfp4moe_Status want, const char* needle, int line) {
  const char* msg = nvfp4moe_last_error();
  if (got != want || strstr(msg, needle) == NULL) {
    fprintf(stderr, "c_api_errors.c:%d: FAILED: status %d (%s), message \"%s\"; wanted %d with \"%s\"\n", line, (int)got,
            nvfp4moe_status_string(got), msg, (int)want, needle);
    ++failures;
  }
}
#define EXPECT_STATUS(call, want, needle) expect_status((call), NVFP4MOE_Status_##want, (needle), __LINE__)
#define EXPECT(cond)                                                          \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "c_api_errors.c:%d: FAILED: %s\n", __LINE__, #cond); \
      ++failures;                                                             \
    }                                                                         \
  } while (0)

int main(void) {
  EXPECT(nvfp4moe_version() == NVFP4MOE_VERSION);
  EXPECT(strcmp(nvfp4moe_status_string(NVFP4MOE_Status_kInvalidHandle), "invalid handle") == 0);

  /* Weights: null and short argument structs, shapes, decode scales (all before any CUDA call). */
  nvfp4moe_weights* w = (nvfp4moe_weights*)0x1;
  EXPECT_STATUS(nvfp4moe_weights_create(NULL, NULL, &w), kNullPointer, "null arguments");
  EXPECT(w == NULL);
  nvfp4moe_WeightsCreateArgs wa;
  memset(&wa, 0, sizeof wa);
  wa.struct_size = 8;
  EXPECT_STATUS(nvfp4moe_weights_create(&wa, NULL, &w), kInvalidShape, "struct_size");
  wa.struct_size = sizeof wa;
  EXPECT_STATUS(nvfp4moe_weights_create(&wa, NULL, NULL), kNullPointer, "null out");
  wa.experts = 2;
  wa.n = 96; /* not a multiple of 64 */
  wa.k = 128;
  EXPECT_STATUS(nvfp4moe_weights_create(&wa, NULL, &w), kInvalidShape, "");
  wa.n = 128;
  EXPECT_STATUS(nvfp4moe_weights_create(&wa, NULL, &w), kNullPointer, "decode scales");
  static unsigned char fake[64];
  const float g[2] = {0.5f, NAN};
  wa.codes = fake;
  wa.scales = fake;
  wa.decode_scales = g;
  EXPECT_STATUS(nvfp4moe_weights_create(&wa, NULL, &w), kInvalidDecodeScale, "expert 1");
  const float g_ok[2] = {0.5f, 0.25f}, up_bad[2] = {1.0f, -1.0f};
  wa.decode_scales = g_ok;
  wa.up_decode_scales = up_bad;
  EXPECT_STATUS(nvfp4moe_weights_create(&wa, NULL, &w), kInvalidDecodeScale, "up rows' decode scale of expert 1");
  EXPECT(nvfp4moe_weights_destroy(NULL) == NVFP4MOE_Status_kSuccess);

  /* Layers: null handles. */
  nvfp4moe_layer* layer = (nvfp4moe_layer*)0x1;
  nvfp4moe_LayerCreateArgs la;
  memset(&la, 0, sizeof la);
  la.struct_size = sizeof la;
  EXPECT_STATUS(nvfp4moe_layer_create(&la, &layer), kInvalidHandle, "null weights handle");
  EXPECT(layer == NULL);
  la.struct_size = sizeof la - 4;
  EXPECT_STATUS(nvfp4moe_layer_create(&la, &layer), kInvalidShape, "struct_size");
  EXPECT(nvfp4moe_layer_destroy(NULL) == NVFP4MOE_Status_kSuccess);
  size_t bytes = 0;
  EXPECT_STATUS(nvfp4moe_layer_workspace_size(NULL, &bytes), kInvalidHandle, "null layer");
  EXPECT_STATUS(nvfp4moe_layer_workspace_init(NULL, fake, sizeof fake, NULL), kInvalidHandle, "null layer");
  nvfp4moe_ForwardArgs fa;
  memset(&fa, 0, sizeof fa);
  fa.struct_size = sizeof fa;
  EXPECT_STATUS(nvfp4moe_layer_forward(NULL, &fa, NULL), kInvalidHandle, "null layer");
  int32_t found = 0, id = 0;
  int64_t token = 0, slot = 0;
  EXPECT_STATUS(nvfp4moe_layer_check(NULL, fake, sizeof fake, 2, NULL, &found, &token, &slot, &id), kInvalidHandle,
                "null layer");

  if (failures) {
    fprintf(stderr, "c_api_errors: %d failed\n", failures);
    return 1;
  }
  printf("c_api_errors: all passed (nvfp4moe %d)\n", nvfp4moe_version());
  return 0;
}
