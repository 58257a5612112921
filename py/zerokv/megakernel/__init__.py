"""The Llama decode step as one op, for the MEGAKERNEL engine (cc/engines/megakernel): the op and its
reference (llama_step), and the export of a transformers model's step over runtime-owned caches
(export)."""
