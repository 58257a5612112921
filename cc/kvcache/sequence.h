// Sequence: one conversation's runtime-owned KV caches, one per storage key (a layer's K and V),
// reset and measured on its own.
//
// A zerokv delegate runs each step on a sequence: the one current on the thread (a SequenceGuard)
// if any, else its home, the sequence that was current when it was loaded, or the process's
// implicit sequence when none was. So N conversations over one loaded program are N sequences
// selected around its executes, and loads of one program are kept apart by loading each under a
// sequence of its own:
//
//   std::shared_ptr<Sequence> a = Sequence::Create(), b = Sequence::Create();
//   { SequenceGuard guard(a); module.execute("decode", ...); }   // conversation a
//   { SequenceGuard guard(b); module.execute("prefill", ...); }  // conversation b, same program
//   { SequenceGuard guard(b); other_module.load(); }             // a second load, at home in b
//   a->Reset();
//
// The implicit sequence is what loads without a sequence get: a program's prefill and decode
// methods share it, as they must. Nobody asked for it to be shared between instances of a program,
// so it refuses a second loaded delegate of one method over one storage key, a second instance of
// the program that would silently write the first one's caches: load that under a sequence of its
// own. It lives while some delegate has it as home; an explicit sequence lives while its creator or
// a delegate holds it, and shares its caches with every delegate it is handed to (the caller asked).
//
// Thread safety: every method may be called from any thread. Steps of different sequences run
// concurrently; steps of one cache do not overlap (a second one is refused), nor do a step and a
// reset (refused).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "cc/kvcache/kv_cache.h"

namespace zerokv::kvcache {

class Sequence {
 public:
  // A new sequence, shared with the delegates it is handed to.
  static std::shared_ptr<Sequence> Create();
  // The live implicit sequence, or a new one (for a delegate loaded without a sequence).
  static std::shared_ptr<Sequence> Implicit();
  // The live implicit sequence, or nullptr when no delegate loaded without a sequence is alive.
  static std::shared_ptr<Sequence> FindImplicit();

  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  // The cache of `storage_key`, created with `config` and `ops` at the first call (allocating
  // nothing yet). A cache held with another config (shape, dtype, policy, capacities, device) is
  // refused: two delegates would bind one storage at different layouts.
  Status Acquire(const std::string& storage_key, const KVCacheConfig& config,
                 std::shared_ptr<DeviceOps> ops, std::shared_ptr<KVCache>* cache);
  // The cache of `storage_key`, or nullptr.
  std::shared_ptr<KVCache> Find(const std::string& storage_key) const;

  // Records that a loaded delegate of `method` is at home here with the cache of `storage_key`.
  // The implicit sequence refuses a second one (see above). Release when that delegate goes.
  Status Claim(const std::string& method, const std::string& storage_key);
  void Release(const std::string& method, const std::string& storage_key);

  // Forgets every cache's committed positions (the storage is kept, and zeroed on the stream of
  // the next step); refused, with nothing reset, while a step holds one of them.
  Status Reset();

  // K and V of every cache, summed (length, capacity and position too); `caches` receives how
  // many there are. Host-side bookkeeping: never synchronizes the device.
  KVCacheMetrics Metrics(size_t* caches = nullptr) const;

  // Unique for the process's lifetime (never reused, unlike an address).
  uint64_t id() const { return id_; }

 private:
  Sequence(uint64_t id, bool implicit) : id_(id), implicit_(implicit) {}

  const uint64_t id_;
  const bool implicit_;
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<KVCache>> caches_;
  std::multiset<std::pair<std::string, std::string>> claims_;  // (method, storage key)
};

// The sequence current on this thread (the innermost live SequenceGuard's), or nullptr.
std::shared_ptr<Sequence> CurrentSequence();

// Makes `sequence` (nullptr: none) current on this thread and returns the one it replaces.
std::shared_ptr<Sequence> SelectSequence(std::shared_ptr<Sequence> sequence);

// Makes a sequence current on this thread for its lifetime: delegates loaded meanwhile take it as
// their home, and executes meanwhile run on it. Guards nest.
class SequenceGuard {
 public:
  explicit SequenceGuard(std::shared_ptr<Sequence> sequence)
      : previous_(SelectSequence(std::move(sequence))) {}
  ~SequenceGuard() { SelectSequence(std::move(previous_)); }

  SequenceGuard(const SequenceGuard&) = delete;
  SequenceGuard& operator=(const SequenceGuard&) = delete;

 private:
  std::shared_ptr<Sequence> previous_;
};

}  // namespace zerokv::kvcache
