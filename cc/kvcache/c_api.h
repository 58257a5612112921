/* The runtime-owned KV caches' C API, exported by the zerokv backend shared libraries
 * (libzerokv_backend.so, libzerokv_backend_testing.so) for runners and Python (ctypes):
 *
 *   lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
 *   metrics = ZeroKVCacheMetrics()
 *   if lib.zerokv_kv_metrics(b"model.layers.0.k", ctypes.byref(metrics)) != 0: ...
 *
 * A storage key names one KV layer (K and V) of a loaded program (blob KV manifest storage_key);
 * a cache exists while some loaded delegate names it. Metrics are host-side bookkeeping: reading
 * them never synchronizes the device. */
#ifndef ZEROKV_CC_KVCACHE_C_API_H_
#define ZEROKV_CC_KVCACHE_C_API_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ZeroKVCacheMetrics {
  uint64_t bytes_reserved; /* K and V storage allocated now */
  uint64_t bytes_in_use;   /* K and V bytes of the committed positions */
  uint64_t growths;        /* reallocations that preserved the contents */
  uint64_t bytes_moved;    /* bytes those reallocations copied */
  uint64_t length;         /* committed positions */
  uint64_t capacity;       /* allocated positions (0 before the first step) */
} ZeroKVCacheMetrics;

/* The metrics of the cache named `storage_key`: 0, or -1 when no loaded delegate names it. */
int zerokv_kv_metrics(const char* storage_key, ZeroKVCacheMetrics* out);

/* The sum of the metrics of every cache whose key starts with `key_prefix` (length and capacity
 * are summed too): the number of caches summed, 0 when there is none. */
int zerokv_kv_metrics_sum(const char* key_prefix, ZeroKVCacheMetrics* out);

/* Forgets the committed positions of the cache named `storage_key` (the storage is kept, and
 * zeroed on the stream of the next step): 0, or -1 when no loaded delegate names it. */
int zerokv_kv_reset(const char* storage_key);

/* Resets every cache whose key starts with `key_prefix`; returns how many. */
int zerokv_kv_reset_prefix(const char* key_prefix);

#ifdef __cplusplus
}
#endif

#endif /* ZEROKV_CC_KVCACHE_C_API_H_ */
