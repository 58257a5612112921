"""The ExecuTorch partitioner for zerokv delegates.

It claims the nodes its engine supports, in as few partitions as the graph allows, and tags each
partition with the zerokv backend, the engine kind and `target_device` (which ExecuTorch's
PropagateDevicePass reads to plan the delegate's I/O in device memory). Mutable buffers are never
claimed: KV caches stay above the delegate, owned by the caller. index_copy (the KV write the
engines alias) and attention are kept whole.
"""

from __future__ import annotations

from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from zerokv.executorch import specs
from zerokv.executorch.delegates import BACKEND_ID
from zerokv.executorch.engines import PRESERVED_OPS, engine_module, engine_named


class _EngineSupport(OperatorSupportBase):
    def __init__(self, engine):
        self.engine = engine

    def is_node_supported(self, submodules, node) -> bool:
        return self.engine.supports(node)


def _engine_option_specs(engine, engine_options):
    """Engine options travel to `preprocess` (a static method) as compile specs."""
    return engine_module(engine).options_to_specs(engine_options or {})


class ZeroKVPartitioner(Partitioner):
    """Partitions one method for a zerokv engine.

    Args:
      engine: "aoti", "tensorrt" or "megakernel".
      device: the CUDA device the delegates run on, "cuda:N".
      method: the method's name, carried in the compile specs so that errors can name it.
      zero_copy_kv: whether the caller-owned caches this method writes in place are elided from the
        delegate's outputs (set by zerokv.export, which also repoints the buffer mutations).
      engine_options: passed to the engine adapter (e.g. TensorRT `profiles`).
      placeholder_marks: {placeholder name: {meta key: value}} set on the method's placeholders
        before tagging: how zerokv.export's marks (caches promised in-place writes, runtime-owned
        caches) reach `preprocess`, since ExecuTorch's re-tracing drops user inputs' meta.
      export_ranges: the range constraints of the method's torch.export program, which the Edge
        program narrows (see _restore_export_ranges); the delegates' engines are built over these.
      named_data: where the delegates' weights and plans go: "ptd" (a data file beside the .pte) or
        "pte" (the .pte's named data segment).
    """

    def __init__(self, engine="aoti", device="cuda:0", method="forward", zero_copy_kv=False, engine_options=None,
                 placeholder_marks=None, export_ranges=None, named_data="ptd"):
        specs.parse_device(device)
        specs.parse_named_data(named_data)
        option_specs = _engine_option_specs(engine, engine_options)
        self.engine_name = engine
        self.engine = engine_named(engine, **(engine_options or {}))
        self.placeholder_marks = placeholder_marks or {}
        self.export_ranges = export_ranges or {}
        self.delegation_spec = DelegationSpec(
            BACKEND_ID,
            [
                CompileSpec(specs.TARGET_DEVICE, device.encode()),
                CompileSpec(specs.ENGINE, engine.encode()),
                CompileSpec(specs.METHOD, method.encode()),
                CompileSpec(specs.ZERO_COPY_KV, b"1" if zero_copy_kv else b"0"),
                CompileSpec(specs.NAMED_DATA, named_data.encode()),
                *option_specs,
            ],
        )

    def ops_to_not_decompose(self, ep):
        return list(PRESERVED_OPS), None

    def partition(self, exported_program) -> PartitionResult:
        graph_module = exported_program.graph_module
        for node in graph_module.graph.find_nodes(op="placeholder"):
            node.meta.update(self.placeholder_marks.get(node.name, {}))
        _restore_export_ranges(exported_program, self.export_ranges)
        partitions = CapabilityBasedPartitioner(
            graph_module, _EngineSupport(self.engine), allows_single_node_partition=True
        ).propose_partitions()
        tags = {}
        for partition in partitions:
            tag = f"zerokv_{partition.id}"
            for node in partition.nodes:
                node.meta["delegation_tag"] = tag
            tags[tag] = self.delegation_spec
        tag_constant_data(exported_program)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


def _restore_export_ranges(exported_program, export_ranges):
    """Gives the Edge program back the dimension ranges torch.export verified its program over.

    ExecuTorch recomputes an Edge program's range constraints from the shape environment, where a
    size is at least 2 (0 and 1 are specialised): a query length exported as 1..16 comes out 2..16,
    and an engine built over that (a TensorRT profile) refuses a one-token decode. Each delegate's
    program copies these constraints when it is cut from the method's.
    """
    ranges = exported_program.range_constraints
    for symbol in ranges.keys() & export_ranges.keys():
        ranges[symbol] = export_ranges[symbol]


class KeepingZeroKVOps(Partitioner):
    """Another backend's partitioner that leaves zerokv's preserved ops whole.

    ExecuTorch decomposes once per partitioner, with that partitioner's own exceptions; without this
    a later partitioner would decompose index_copy, and zerokv's engine would no longer see the
    KV write it aliases.
    """

    def __init__(self, inner: Partitioner):
        super().__init__()
        self.inner = inner
        self.delegation_spec = inner.delegation_spec

    def ops_to_not_decompose(self, ep):
        ops, check = self.inner.ops_to_not_decompose(ep)

        def keep(node):
            return node.target in PRESERVED_OPS or check is None or check(node)

        return list(ops) + [op for op in PRESERVED_OPS if op not in ops], keep

    def partition(self, exported_program) -> PartitionResult:
        return self.inner.partition(exported_program)
