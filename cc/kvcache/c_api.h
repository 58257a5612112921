/* The runtime-owned KV caches' C API, exported by the zerokv backend shared libraries
 * (libzerokv_backend.so, libzerokv_backend_testing.so, ...) for runners and Python (ctypes).
 *
 * A sequence is one conversation's caches (zerokv::kvcache::Sequence, sequence.h). A delegate runs
 * each step on the sequence selected on the calling thread, else on its home: the sequence that
 * was selected when it was loaded, or the implicit sequence of loads without one. A second load of
 * a program without a sequence of its own is refused (it would share the first one's caches).
 *
 *   lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
 *   a = lib.zerokv_kv_sequence_create()
 *   lib.zerokv_kv_sequence_select(a)      # this thread: loads take it as home, executes run on it
 *   program = runtime.load_program(path); method = program.load_method("decode"); ...
 *   lib.zerokv_kv_sequence_select(None)
 *   lib.zerokv_kv_sequence_metrics(a, ctypes.byref(metrics)); lib.zerokv_kv_sequence_reset(a)
 *   lib.zerokv_kv_sequence_release(a)
 *
 * Handles are references: each one returned is released once. Metrics are host-side bookkeeping:
 * reading them never synchronizes the device. Every function may be called from any thread. */
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
  uint64_t length;         /* committed positions held (a ring's stops at its window) */
  uint64_t capacity;       /* allocated positions (0 before the first step) */
  uint64_t position;       /* tokens committed since the last reset: the next step's first position */
} ZeroKVCacheMetrics;

typedef struct ZeroKVSequence ZeroKVSequence;

/* A new sequence (never NULL). */
ZeroKVSequence* zerokv_kv_sequence_create(void);

/* The implicit sequence of the programs loaded without one, or NULL when none is loaded. */
ZeroKVSequence* zerokv_kv_implicit_sequence(void);

/* Releases this reference; the caches live on while a loaded delegate is at home in the sequence. */
void zerokv_kv_sequence_release(ZeroKVSequence* sequence);

/* Selects `sequence` on the calling thread (NULL: none): delegates loaded meanwhile take it as
 * their home, and executes meanwhile run on it. */
void zerokv_kv_sequence_select(ZeroKVSequence* sequence);

/* The metrics of every cache of `sequence`, summed (length, capacity and position too): the
 * number of caches, 0 when it has none yet. */
int zerokv_kv_sequence_metrics(const ZeroKVSequence* sequence, ZeroKVCacheMetrics* out);

/* Forgets the committed positions of every cache of `sequence` (the storage is kept, and zeroed on
 * the stream of the next step): 0, or -1 with nothing reset when a step is in flight on one of
 * them (the reason is logged). */
int zerokv_kv_sequence_reset(ZeroKVSequence* sequence);

#ifdef __cplusplus
}
#endif

#endif /* ZEROKV_CC_KVCACHE_C_API_H_ */
