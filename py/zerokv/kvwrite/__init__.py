"""KV cache write analysis: which writes are one contiguous run of positions.

Independent of any backend; see analysis.py.
"""

from zerokv.kvwrite.analysis import (
    DEFAULT_SEQUENCE_DIM,
    ConstantLookup,
    ContiguousWrite,
    DeclinedWrite,
    KVWriteAnalysis,
    KVWriteOp,
    Position,
    WriteStart,
    analyze_kv_write,
    analyze_kv_writes,
    describe_kv_write,
    describes_positions,
    exported_program_constants,
    is_kv_write,
    module_attribute_constants,
    op_overload,
)
from zerokv.kvwrite.readers import declare_reads_rows_before, unaffected_by

__all__ = [
    "DEFAULT_SEQUENCE_DIM",
    "ConstantLookup",
    "ContiguousWrite",
    "DeclinedWrite",
    "KVWriteAnalysis",
    "KVWriteOp",
    "Position",
    "WriteStart",
    "analyze_kv_write",
    "analyze_kv_writes",
    "declare_reads_rows_before",
    "describe_kv_write",
    "describes_positions",
    "exported_program_constants",
    "is_kv_write",
    "module_attribute_constants",
    "op_overload",
    "unaffected_by",
]
