"""ZeroKVBackend: ExecuTorch's `preprocess` for zerokv delegates, which writes the blob.

The delegate's program is compiled by its engine (compile spec `zerokv.engine`). Caller-owned caches
that zero_copy.py promised in-place writes for are marked on their placeholders; the engine must
report each of them as aliased, the blob records the aliased I/O and that the aliased outputs are
elided, and anything short of that refuses the export: a write is never silently dropped.

The blob carries metadata and engine code only. Weights and plans go to ExecuTorch's named data
(PreprocessResult.data_store_output), in a .ptd beside the .pte or in the .pte's own segment
(compile spec `zerokv.named_data`); the runtime reads them through the NamedDataMap at init.
"""

from __future__ import annotations

from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from torch.export.graph_signature import InputKind

from zerokv import blob
from zerokv.aoti import NAMED_DATA_ALIGNMENT
from zerokv.errors import ZeroKVError
from zerokv.executorch import specs
from zerokv.executorch.delegates import ALIASED_BUFFER, RUNTIME_KV
from zerokv.executorch.engine_build import EngineBuildError
from zerokv.executorch.engine_program import engine_program
from zerokv.executorch.engines import ENGINE_KINDS, engine_module, engine_named, written_back
from zerokv.executorch.runtime_kv import manifest_layers, positions_binding, step_width_source
from zerokv.kvwrite import is_kv_write


class ZeroCopyError(ZeroKVError, RuntimeError):
    """Zero-copy KV cannot be applied as asked; the message names the buffer, the method and the fix."""


def _describe(method, user_inputs):
    return f"method '{method}', delegate over ({', '.join(user_inputs)})"


class ZeroKVBackend(BackendDetails):
    @staticmethod
    def preprocess(edge_program, compile_specs) -> PreprocessResult:
        engine_name = specs.read(compile_specs, specs.ENGINE)
        if engine_name not in ENGINE_KINDS:
            raise ZeroKVError(f"compile spec {specs.ENGINE}={engine_name!r}: expected one of {sorted(ENGINE_KINDS)}")
        device = specs.read(compile_specs, specs.TARGET_DEVICE, "cuda:0")
        device_index = specs.parse_device(device)
        method = specs.read(compile_specs, specs.METHOD, "forward")
        zero_copy_kv = specs.read(compile_specs, specs.ZERO_COPY_KV, "0") == "1"
        named_data_place = specs.parse_named_data(specs.read(compile_specs, specs.NAMED_DATA, "ptd"))

        signature = edge_program.graph_signature
        user_inputs = [spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
        delegate = _describe(method, user_inputs)
        placeholders = {node.name: node for node in edge_program.graph.find_nodes(op="placeholder")}
        promised = {name: placeholders[name].meta[ALIASED_BUFFER] for name in user_inputs
                    if ALIASED_BUFFER in placeholders[name].meta}
        runtime_owned = [placeholders[name] for name in user_inputs if RUNTIME_KV in placeholders[name].meta]
        arguments = [name for name in user_inputs if RUNTIME_KV not in placeholders[name].meta]
        if promised and not zero_copy_kv:
            raise ZeroCopyError(f"{delegate}: caches {sorted(promised.values())} were repointed for zero-copy, "
                                "but the delegate was not partitioned with zero_copy_kv")
        _refuse_cache_value_outputs(edge_program, promised, delegate)

        engine = engine_named(engine_name, **engine_options_from_specs(engine_name, compile_specs))
        in_place = [*promised, *(node.name for node in runtime_owned)]
        program = engine_program(edge_program, in_place, delegate)
        try:
            build = engine.build(program, in_place, device)
        except ZeroKVError as error:
            raise EngineBuildError(f"{delegate}: the {engine_name} engine cannot build it: {error}") from error

        aliased_inputs = {alias.input for alias in build.aliased_io}
        missing_runtime = {node.name for node in runtime_owned} - aliased_inputs
        if missing_runtime:
            raise ZeroCopyError(f"{delegate}: the engine does not write the runtime-owned caches "
                                f"{sorted(missing_runtime)} in place")
        aliased_inputs -= {node.name for node in runtime_owned}
        lost = set(promised) - aliased_inputs
        if lost:
            raise ZeroCopyError(
                f"{delegate}: the engine does not write {sorted(promised[name] for name in lost)} in place, "
                "though their copy-back was removed on that promise; the update would be lost. Export with "
                "zero_copy_kv=False to keep ExecuTorch's copy-back")
        unpromised = aliased_inputs - set(promised)
        if unpromised:
            raise ZeroCopyError(
                f"{delegate}: the engine aliases {sorted(unpromised)} whose outputs are still delegate outputs; "
                "a partial elision cannot be expressed to the runtime")

        elided = bool(promised)
        metadata = blob.Metadata(
            bindings=build.bindings,
            aliased_io=build.aliased_io,
            kv_layers=manifest_layers(runtime_owned, build.bindings, delegate),
            step_width_source=step_width_source(runtime_owned, arguments, delegate),
            positions_binding=positions_binding(runtime_owned, arguments, delegate),
            engine_key=build.engine_key,
            constants=build.constants,
        )
        delegate_signature = blob.delegate_signature(metadata, elided)
        # The writes of runtime-owned caches leave the delegate's outputs after lowering (runtime_kv).
        outputs = len(signature.user_outputs) - len(_returned_writes(edge_program, runtime_owned))
        if (len(delegate_signature.inputs), len(delegate_signature.outputs)) != (len(arguments), outputs):
            raise ZeroCopyError(
                f"{delegate}: the engine takes {len(delegate_signature.inputs)} inputs and gives "
                f"{len(delegate_signature.outputs)} outputs as delegate arguments, but the delegate has "
                f"{len(arguments)} inputs and {outputs} outputs")
        processed = blob.serialize(blob.Blob(
            engine_kind=engine.kind,
            device_id=device_index,
            aliased_outputs_elided=elided,
            metadata=metadata,
            payload=build.payload,
        ))
        store = NamedDataStore()
        tag = specs.NAMED_DATA_TAG if named_data_place == "ptd" else None
        for key, data in build.named_data.items():
            store.add_named_data(key, data, alignment=NAMED_DATA_ALIGNMENT, external_tag=tag)
        return PreprocessResult(processed_bytes=processed, data_store_output=store.get_named_data_store_output())


def _returned_writes(edge_program, caches):
    returned = edge_program.graph.output_node().args[0]
    writes = []
    for cache in caches:
        writes += [value for value in returned if is_kv_write(written_back(value, cache))
                   and written_back(value, cache).args[0] is cache]
    return writes


def _refuse_cache_value_outputs(edge_program, promised, delegate):
    """An updated cache read outside the delegate would have to leave it as a cache-sized copy."""
    output_node = edge_program.graph.output_node()
    returned = set(output_node.args[0])
    for name, buffer in promised.items():
        cache = next(node for node in edge_program.graph.find_nodes(op="placeholder") if node.name == name)
        for write in cache.users:
            if write in returned:
                raise ZeroCopyError(
                    f"{delegate}: the updated value of cache '{buffer}' is read outside the delegate; "
                    "zero-copy KV needs every read of it in the delegate that writes it: let the engine run "
                    "that read, or export with zero_copy_kv=False to keep ExecuTorch's copy-back")


def engine_options_from_specs(engine_name, compile_specs):
    return engine_module(engine_name).options_from_specs(compile_specs)
