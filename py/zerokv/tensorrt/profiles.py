"""Optimization profiles: the ranges of dynamic dimensions one engine serves.

A profile is written against the exported program's user inputs ("input_ids",
axis 1) and resolved to torch.export's symbols, so every network input whose
extent depends on the same symbol (the query, a mask, an update) gets a
consistent range without the caller listing them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import sympy
import torch

from zerokv.errors import ZeroKVError


class ProfileError(ZeroKVError, ValueError):
    """A profile does not fit the exported program; the message names the input or symbol."""


@dataclasses.dataclass(frozen=True)
class DimRange:
    """The extents a dynamic dimension takes in one profile; `opt` is what TensorRT tunes for."""

    min: int
    opt: int
    max: int

    def __post_init__(self):
        if not 0 <= self.min <= self.opt <= self.max:
            raise ProfileError(f"dimension range needs 0 <= min <= opt <= max, got {self}")


@dataclasses.dataclass(frozen=True)
class Profile:
    """One optimization profile: (user input name, axis) -> range of that dynamic axis."""

    name: str
    dims: Mapping[tuple[str, int], DimRange]


def decode_and_prefill_profiles(
    query_input: str, query_axis: int, max_prefill: int, prefill_opt: int | None = None
) -> tuple[Profile, Profile]:
    """The two profiles of a decoder engine: decode [.., 1] and prefill [.., 1..max_prefill]."""
    if max_prefill < 1:
        raise ProfileError(f"max_prefill must be at least 1, got {max_prefill}")
    key = (query_input, query_axis)
    return (
        Profile("decode", {key: DimRange(1, 1, 1)}),
        Profile("prefill", {key: DimRange(1, prefill_opt or max_prefill, max_prefill)}),
    )


@dataclasses.dataclass(frozen=True)
class ResolvedProfile:
    """A profile evaluated for every dynamic network input: name -> (min, opt, max) shapes.

    `ranges` is the same profile per export symbol, to evaluate any other extent.
    """

    name: str
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    ranges: Mapping[sympy.Symbol, DimRange]

    def evaluate(self, extent, which: str) -> int:
        """A static or symbolic extent at this profile's min, opt or max."""
        return _evaluate(extent, self.ranges, which)


def resolve_profiles(
    profiles: Sequence[Profile],
    user_inputs: Mapping[str, torch.Tensor],
    network_inputs: Mapping[str, torch.Tensor],
    range_constraints: Mapping[sympy.Symbol, object],
) -> list[ResolvedProfile]:
    """Evaluates `profiles` for every network input with a dynamic extent.

    Args:
      profiles: the requested profiles; empty means one spanning the export's ranges.
      user_inputs: user input name -> its fake tensor (meta["val"]), to find symbols.
      network_inputs: network input name -> fake tensor, for every network input.
      range_constraints: the ExportedProgram's symbol ranges, which profiles must respect.
    """
    symbols = sorted(
        {s for value in network_inputs.values() for s in _free_symbols(value)}, key=str
    )
    if not symbols:
        if profiles:
            raise ProfileError("profiles were given but the program has no dynamic dimension")
        return []
    if profiles:
        named = [(p.name, _symbol_ranges(p, user_inputs, range_constraints)) for p in profiles]
    else:
        named = [("default", _export_ranges(symbols, range_constraints))]
    resolved = []
    for profile_name, bindings in named:
        missing = [str(s) for s in symbols if s not in bindings]
        if missing:
            raise ProfileError(
                f"profile '{profile_name}' gives no range for symbol(s) {', '.join(missing)}; "
                "name an (input, axis) of the user inputs that carries each"
            )
        shapes = {}
        for name, value in network_inputs.items():
            if any(_free_symbols(value)):
                shapes[name] = tuple(
                    tuple(_evaluate(extent, bindings, which) for extent in value.shape)
                    for which in ("min", "opt", "max")
                )
        resolved.append(ResolvedProfile(profile_name, shapes, bindings))
    return resolved


def _export_ranges(symbols, range_constraints) -> dict[sympy.Symbol, DimRange]:
    ranges = {}
    for symbol in symbols:
        constraint = range_constraints.get(symbol)
        if constraint is None or not constraint.upper.is_finite:
            raise ProfileError(f"symbol {symbol} has no finite export range: pass profiles")
        lower, upper = int(constraint.lower), int(constraint.upper)
        ranges[symbol] = DimRange(lower, upper, upper)
    return ranges


def _symbol_ranges(profile: Profile, user_inputs, range_constraints) -> dict[sympy.Symbol, DimRange]:
    bindings: dict[sympy.Symbol, DimRange] = {}
    for (input_name, axis), dim_range in profile.dims.items():
        value = user_inputs.get(input_name)
        if value is None:
            raise ProfileError(
                f"profile '{profile.name}' names input '{input_name}', which is not a user "
                f"input (user inputs: {', '.join(user_inputs) or 'none'})"
            )
        if not -value.dim() <= axis < value.dim():
            raise ProfileError(f"profile '{profile.name}': input '{input_name}' has no axis {axis}")
        extent = value.shape[axis]
        if not isinstance(extent, torch.SymInt) or not isinstance(extent.node.expr, sympy.Symbol):
            raise ProfileError(
                f"profile '{profile.name}': axis {axis} of input '{input_name}' is not a "
                "dynamic dimension of the export"
            )
        symbol = extent.node.expr
        constraint = range_constraints.get(symbol)
        if constraint is not None and not (
            int(constraint.lower) <= dim_range.min and dim_range.max <= constraint.upper
        ):
            raise ProfileError(
                f"profile '{profile.name}': range {dim_range.min}..{dim_range.max} of input "
                f"'{input_name}' axis {axis} lies outside the export's range "
                f"{constraint.lower}..{constraint.upper}"
            )
        bindings[symbol] = dim_range
    return bindings


def _free_symbols(value: torch.Tensor):
    for extent in value.shape:
        if isinstance(extent, torch.SymInt):
            yield from extent.node.expr.free_symbols


def _evaluate(extent, bindings, which: str) -> int:
    if not isinstance(extent, torch.SymInt):
        return int(extent)
    expr = extent.node.expr
    substitution = {s: getattr(bindings[s], which) for s in expr.free_symbols if s in bindings}
    return int(expr.subs(substitution))
