/* A fake libcuda.so.1 for gpu-check's dry run (tests/dry-run.sh): no GPU, but the driver calls
 * gpu-check makes behave like an 80 GiB GPU with 132 SMs, honouring the MPS variables the way the MPS
 * client does (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT caps allocations, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
 * scales the SMs a kernel runs on) when CUDA_MPS_PIPE_DIRECTORY is set. Kernel launches sleep for the
 * time the work would take. Build: cc -shared -fPIC -o libcuda.so.1 libcuda.c */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_IMAGE = 200, NOT_FOUND = 500 };

#define MIB (1ull << 20)
static const unsigned long long TOTAL = 81559ull * MIB, OVERHEAD = 512ull * MIB;
static unsigned long long used, limit;
static int inited, sms = 132;
static char ctx_dummy, mod_dummy, fn_dummy;

static int mps(void) { const char *p = getenv("CUDA_MPS_PIPE_DIRECTORY"); return p && *p; }

CUresult cuGetErrorString(CUresult e, const char **s) {
  *s = e == OUT_OF_MEMORY ? "out of memory" : e == INVALID_IMAGE ? "device kernel image is invalid" : "fake error";
  return OK;
}
CUresult cuInit(unsigned flags) {
  (void)flags;
  inited = 1;
  limit = TOTAL;
  if (mps()) {
    const char *l = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), *t = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    if (l && strncmp(l, "0=", 2) == 0) limit = strtoull(l + 2, NULL, 10) * MIB;
    if (t) sms = (int)(132 * atof(t) / 100.0 + 0.5);
    if (sms < 1) sms = 1;
  }
  return OK;
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { if (!inited) return NOT_INITIALIZED; *n = 1; return OK; }
CUresult cuDeviceGet(CUdevice *d, int o) { if (o != 0) return INVALID_VALUE; *d = 0; return OK; }
CUresult cuDeviceGetName(char *n, int len, CUdevice d) { (void)d; snprintf(n, len, "Fake H100 (gpu-check dry run)"); return OK; }
CUresult cuDeviceGetPCIBusId(char *n, int len, CUdevice d) { (void)d; snprintf(n, len, "0000:00:04.0"); return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) { (void)d; *v = attr == 16 ? sms : 0; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) { (void)d; *ctx = &ctx_dummy; used = OVERHEAD; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return OK; }
CUresult cuCtxSynchronize(void) { return OK; }
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { *f = limit - used; *t = limit; return OK; }
/* live allocations: address -> size (addresses are never reused) */
static CUdeviceptr next_ptr = 0x100000000ull, ptrs[65536];
static size_t sizes[65536];
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  int i;
  if (used + n > limit) return OUT_OF_MEMORY;
  for (i = 0; i < 65536 && ptrs[i]; i++) {}
  if (i == 65536) return OUT_OF_MEMORY;
  ptrs[i] = *p = next_ptr;
  sizes[i] = n;
  next_ptr += n + MIB;
  used += n;
  return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  for (int i = 0; i < 65536; i++)
    if (ptrs[i] == p) { ptrs[i] = 0; used -= sizes[i]; return OK; }
  return INVALID_VALUE;
}
/* for the fake libnvidia-ml (fake/nvml.c): this process's device memory in use */
unsigned long long gpucheck_fake_used(void) { return inited ? used : 0; }
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) { (void)p; (void)v; (void)n; return OK; }
CUresult cuModuleLoadData(void **m, const void *image) {
  if (!strstr((const char *)image, ".entry spin")) return INVALID_IMAGE;
  *m = &mod_dummy;
  return OK;
}
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  (void)m;
  if (strcmp(name, "spin")) return NOT_FOUND;
  *f = &fn_dummy;
  return OK;
}
/* 8 FMAs a round per thread; 128 FMA lanes per SM at 2 GHz, on at most `sms` SMs. */
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, void *stream, void **params, void **extra) {
  (void)f; (void)gy; (void)gz; (void)by; (void)bz; (void)shm; (void)stream; (void)extra;
  unsigned iters = *(unsigned *)params[1];
  double fmas = 8.0 * iters * (double)gx * bx;
  double ns = fmas / (sms * 128.0 * 2.0) + 5000.0;
  struct timespec ts = {(time_t)(ns / 1e9), (long)((unsigned long long)ns % 1000000000ull)};
  nanosleep(&ts, NULL);
  return OK;
}
