"""The TensorRT engine kind: zerokv.tensorrt's lowering, as an engine build for the blob.

Engines are built (a real plan, with TensorRT or with TensorRT-RTX on a CPU-only machine) but can
only run where TensorRT supports the GPU; see cc/engines/tensorrt/README.md.
"""

from __future__ import annotations

import json

from executorch.exir.backend.compile_spec_schema import CompileSpec

from zerokv import blob
from zerokv.aoti import named_data_key
from zerokv.errors import ZeroKVError
from zerokv.executorch import specs
from zerokv.executorch.engine_build import EngineBuild, blob_dtype, check_option_names
from zerokv.tensorrt.lowering import DynamicDim, lower_to_tensorrt
from zerokv.tensorrt.profiles import DimRange, Profile

PROFILES_SPEC = "zerokv.tensorrt.profiles"


def options_to_specs(options):
    """{"profiles": [Profile, ...]} as compile specs (JSON of each profile's ranges)."""
    check_option_names("tensorrt", options, ("profiles",))
    if not options:
        return []
    profiles = options["profiles"]
    if not isinstance(profiles, (list, tuple)) or not all(isinstance(profile, Profile) for profile in profiles):
        raise ZeroKVError(f"engine_options['profiles']: expected a list of zerokv.tensorrt.profiles.Profile "
                          f"(e.g. decode_and_prefill_profiles(...)), got {profiles!r}")
    encoded = [
        {"name": profile.name,
         "dims": [[name, axis, r.min, r.opt, r.max] for (name, axis), r in sorted(profile.dims.items())]}
        for profile in profiles
    ]
    return [CompileSpec(PROFILES_SPEC, json.dumps(encoded, sort_keys=True).encode())]


def options_from_specs(compile_specs):
    encoded = specs.read(compile_specs, PROFILES_SPEC)
    if not encoded:
        return {}
    profiles = [
        Profile(entry["name"], {(name, axis): DimRange(low, opt, high) for name, axis, low, opt, high in entry["dims"]})
        for entry in json.loads(encoded)
    ]
    return {"profiles": profiles}


def _blob_shape(shape):
    return [blob.Dim(d.min, d.max) if isinstance(d, DynamicDim) else blob.Dim(int(d), int(d)) for d in shape]


def build(program, aliased_inputs, device: str, profiles) -> EngineBuild:
    lowered = lower_to_tensorrt(program, profiles or (), promised_aliases=tuple(aliased_inputs))
    bindings = [
        blob.IOBinding(
            name=binding.name,
            dtype=blob_dtype(binding.dtype, f"TensorRT binding '{binding.name}'"),
            direction=blob.Direction.INPUT if binding.is_input else blob.Direction.OUTPUT,
            device=blob.Device.CUDA,
            shape=_blob_shape(binding.shape),
        )
        for binding in lowered.io_bindings
    ]
    aliased_io = [blob.AliasedIO(a.output, a.input, blob.AliasKind.KV_CACHE_UPDATE) for a in lowered.aliased_io]
    # The plan holds the weights: all of it is named data, and the blob keeps only its key.
    key = named_data_key(lowered.serialized_plan)
    return EngineBuild(payload=b"", bindings=bindings, aliased_io=aliased_io,
                       named_data={key: lowered.serialized_plan}, engine_key=key)
