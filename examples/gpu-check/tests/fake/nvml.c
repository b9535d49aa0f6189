/* A fake libnvidia-ml.so.1 for gpu-check's dry run: one 80 GiB GPU whose free memory is what this
 * process's fake libcuda (fake/libcuda.c) has not handed out. Build:
 * cc -shared -fPIC -o libnvidia-ml.so.1 nvml.c -L. -l:libcuda.so.1 */
#include <string.h>
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
extern unsigned long long gpucheck_fake_used(void);
static const unsigned long long TOTAL = 81559ull << 20;
static int dev;
int nvmlInit_v2(void) { return 0; }
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **d) {
  if (strcmp(bus, "0000:00:04.0")) return 6; /* NVML_ERROR_NOT_FOUND */
  *d = &dev;
  return 0;
}
int nvmlDeviceGetMemoryInfo(void *d, nvmlMemory_t *m) {
  (void)d;
  m->total = TOTAL;
  m->used = gpucheck_fake_used();
  m->free = TOTAL - m->used;
  return 0;
}
