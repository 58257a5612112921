"""What every zerokv.executorch module may know about marks and delegates: the bottom of the
package's imports, so that the passes, the backend and runtime_kv can share it without a cycle.

The node meta keys that carry a decision from export to `preprocess` and back, and how a zerokv
delegate is found in a lowered graph and its blob read.
"""

from executorch.exir.delegate import executorch_call_delegate
from executorch.exir.passes.propagate_device_pass import _get_lowered_module

from zerokv import blob
from zerokv.errors import ZeroKVError

# Node meta key on a cache placeholder whose write was promised to land in place (value: its FQN).
ALIASED_BUFFER = "zerokv_aliased_buffer"
# Node meta key on a runtime-owned cache input: its runtime_kv.RuntimeKVBinding.
RUNTIME_KV = "zerokv_runtime_kv"
# ExecuTorch finds a delegate's backend by this name among the BackendDetails classes: it is the
# name of backend.ZeroKVBackend (every export fails if they differ).
BACKEND_ID = "ZeroKVBackend"


def delegate_nodes(graph_module):
    """(call node, lowered module) of each delegate call in `graph_module`, of any backend."""
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is executorch_call_delegate:
            lowered = _get_lowered_module(graph_module, node)
            if lowered is not None:
                yield node, lowered


def is_zerokv_delegate(lowered_module) -> bool:
    return getattr(lowered_module, "backend_id", None) == BACKEND_ID


def sole_delegate_blob(graph_module) -> bytes:
    """The blob of a lowered method's one zerokv delegate (what a bare engine runs), or ZeroKVError
    saying how many the method has."""
    blobs = [lowered.processed_bytes for _, lowered in delegate_nodes(graph_module) if is_zerokv_delegate(lowered)]
    if len(blobs) != 1:
        raise ZeroKVError(f"expected one zerokv delegate in the method, found {len(blobs)}")
    return blobs[0]


def parsed_blob(lowered_module):
    return blob.parse(lowered_module.processed_bytes)
