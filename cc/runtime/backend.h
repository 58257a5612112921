// The zerokv ExecuTorch backend, registered as "ZeroKVBackend" at static initialisation of
// //cc/runtime:backend (alwayslink), so that linking it (or loading libzerokv_backend.so with
// RTLD_GLOBAL) is what makes ExecuTorch able to run zerokv delegates.
//
//   init     parse the blob (cc/blob), create the engine its engine kind names (cc/engines), check
//            the blob against the engine (Delegate::Create)
//   execute  Delegate::Execute: bind, enqueue on the caller's or the delegate's stream
//   destroy  drain the in-flight work and free everything
#pragma once

namespace zerokv::runtime {

// The backend ID that preprocess writes into the program (py/zerokv/executorch).
inline constexpr char kBackendName[] = "ZeroKVBackend";

}  // namespace zerokv::runtime
