"""The loader's side of quantized checkpoints (the formats themselves are layers/quant/).

1. `quantize_modules`, on the meta model before anything is allocated: every projection the WeightFormat
   quantizes becomes a QuantLinear, every MoE block's experts a QuantExperts (no bf16 copy is ever made).
2. `QuantTensors.take` routes each checkpoint tensor of those modules (`<projection>.<suffix>`; per-expert
   `experts.{e}.gate_proj.<suffix>`; fused experts `experts.gate_up_proj[_<suffix>]`, [E, ...] as transformers
   names them) to its module, on the device (or in host memory where the scheme stages there).
3. `QuantTensors.finish`, once every file is read: each projection's tensors are checked by its scheme (a missing,
   unexpected or mis-shaped tensor is a WeightLoadError naming it) and converted to the layout fusing takes.
Under tensor parallelism `QuantTensors.placement` tells model/tp_slices.py whose tensor each one is (its scheme and
projection), so that only the rank's slice is read.
`fill_dummy` gives every quantized module random tensors in that layout instead (--load-format dummy).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deltaserve.config import ConfigError
from deltaserve.layers.linear import QuantLinear
from deltaserve.layers.mlp import Experts, QuantExperts
from deltaserve.layers.quant.scheme import Scheme, WeightFormat
from deltaserve.model.errors import WeightLoadError

_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_FUSED_EXPERTS = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)(?:_(\w+))?$")


def quantize_modules(model: nn.Module, fmt: WeightFormat, device) -> None:
    """Swap the projections and experts that `fmt` quantizes for their quantized modules (model on meta)."""
    for name, module in list(model.named_modules()):
        for child in getattr(module, "PROJECTIONS", ()):
            linear = getattr(module, child, None)
            scheme = fmt.scheme_for(f"{name}.{child}") if isinstance(linear, nn.Linear) else None
            if scheme is not None:
                setattr(module, child, QuantLinear(linear.in_features, linear.out_features, scheme, device))
        experts = getattr(module, "experts", None)
        if isinstance(experts, Experts):
            schemes = _expert_schemes(fmt, f"{name}.experts", experts.gate_up_proj.shape[0])
            if schemes is not None:
                num_experts, two_inter, hidden = experts.gate_up_proj.shape
                module.experts = QuantExperts(num_experts, hidden, two_inter // 2, schemes, device)


def _expert_schemes(fmt: WeightFormat, prefix: str, num_experts: int) -> dict | None:
    """projection -> Scheme for a block's experts (None: all stay in the model dtype). Every expert must be stored
    alike: one scheme per projection, and either all three projections quantized or none."""
    schemes = {}
    for proj in _EXPERT_PROJECTIONS:
        found = {fmt.scheme_for(f"{prefix}.{e}.{proj}") for e in range(num_experts)}
        if len(found) > 1:
            raise ConfigError(f"the quantization config stores the experts' {proj} of '{prefix}' in different "
                              "ways (some kept unquantized?); every expert must be stored alike")
        schemes[proj] = found.pop()
    if all(s is None for s in schemes.values()):
        return None
    if any(s is None for s in schemes.values()):
        kept = [p for p, s in schemes.items() if s is None]
        raise ConfigError(f"the quantization config keeps {kept} of '{prefix}' unquantized but not the other expert "
                          "projections; quantized experts need all of gate_proj, up_proj and down_proj quantized")
    if schemes["gate_proj"] is not schemes["up_proj"]:
        raise ConfigError(f"'{prefix}': gate_proj and up_proj are quantized differently; they must match")
    schemes["gate_up_proj"] = schemes["gate_proj"]
    return schemes


def _fused_suffix(scheme, rest: str | None) -> str:
    """A fused expert tensor's suffix (`gate_up_proj_<rest>`) -> the per-matrix tensor name of the scheme."""
    if rest is None:
        return "weight"
    return f"weight_{rest}" if f"weight_{rest}" in scheme.tensors + scheme.optional else rest


class QuantTensors:
    """Collects the checkpoint tensors of a model's quantized modules while the loader reads its files."""

    def __init__(self, model: nn.Module):
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
        self.experts = {name: m for name, m in model.named_modules() if isinstance(m, QuantExperts)}
        self.spelling: dict = {}  # module key -> its checkpoint name, for errors
        self.fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (experts, projection) -> [E, ...] tensors
        self.multimodal = False

    def placement(self, name: str) -> tuple[Scheme, str, str] | None:
        """(scheme, suffix, projection) of checkpoint tensor `name` (ours) where it is one of a quantized module's
        tensors: the projection is its weight's name (`<linear>.weight`, `experts.{e}.<proj>.weight`) or, for a
        fused expert tensor, `experts.gate_up_proj` / `experts.down_proj`. None for any other tensor."""
        prefix, _, suffix = name.rpartition(".")
        if prefix in self.linears:
            scheme, projection = self.linears[prefix].scheme, f"{prefix}.weight"
        elif (expert := _PER_EXPERT.match(name)) and expert.group(1) in self.experts:
            scheme, suffix = self.experts[expert.group(1)].schemes[expert.group(3)], expert.group(4)
            projection = f"{expert.group(1)}.{expert.group(2)}.{expert.group(3)}.weight"
        elif (fused := _FUSED_EXPERTS.match(name)) and fused.group(1) in self.experts:
            scheme = self.experts[fused.group(1)].schemes[fused.group(2)]
            suffix, projection = _fused_suffix(scheme, fused.group(3)), f"{fused.group(1)}.{fused.group(2)}"
        else:
            return None
        return (scheme, suffix, projection) if suffix in scheme.tensors + scheme.optional else None

    def take(self, name: str, raw_name: str, tensor: torch.Tensor) -> bool:
        """Store `tensor` (ours `name`, the checkpoint's `raw_name`) if it belongs to a quantized module."""
        if not (self.linears or self.experts):
            return False
        self.multimodal |= raw_name.startswith("model.language_model.")
        prefix, _, suffix = name.rpartition(".")
        if prefix in self.linears:
            module = self.linears[prefix]
            self._store(module.raw, prefix, raw_name, suffix, module.scheme, tensor, module.device)
            return True
        expert = _PER_EXPERT.match(name)
        if expert and expert.group(1) in self.experts:
            module = self.experts[expert.group(1)]
            e, proj = int(expert.group(2)), expert.group(3)
            if e >= module.num_experts:
                raise WeightLoadError(f"tensor '{raw_name}': expert {e} >= num_experts {module.num_experts}")
            part = module.raw.setdefault((e, proj), {})
            self._store(part, (expert.group(1), e, proj), raw_name, expert.group(4), module.schemes[proj], tensor,
                        module.device)
            return True
        fused = _FUSED_EXPERTS.match(name)
        if fused and fused.group(1) in self.experts:
            module = self.experts[fused.group(1)]
            scheme = module.schemes[fused.group(2)]
            part = self.fused.setdefault((fused.group(1), fused.group(2)), {})
            self._store(part, fused.group(1, 2), raw_name, _fused_suffix(scheme, fused.group(3)), scheme, tensor,
                        module.device)
            return True
        return False

    def _store(self, into: dict, key, raw_name: str, suffix: str, scheme, tensor: torch.Tensor, device) -> None:
        if suffix not in scheme.tensors + scheme.optional:
            raise WeightLoadError(f"unexpected tensor '{raw_name}': this checkpoint's quantized projections have "
                                  f"{list(scheme.tensors + scheme.optional)} (is the module in its ignore list?)")
        if suffix in into:
            raise WeightLoadError(f"tensor '{raw_name}' appears twice in the checkpoint")
        into[suffix] = tensor if scheme.stage_on_host else tensor.to(device)
        self.spelling.setdefault(key, raw_name[: len(raw_name) - len(raw_name.split(".")[-1]) - 1])

    def _spelled(self, key, ours: str) -> str:
        if key in self.spelling:
            return self.spelling[key]
        return ours.replace("model.", "model.language_model.", 1) if self.multimodal else ours

    def _load(self, scheme, prefix: str, raw: dict, shape) -> dict:
        """Check one projection's tensors (named `prefix.<suffix>`) and convert them."""
        missing = [s for s in scheme.tensors if s not in raw]
        if missing:
            raise WeightLoadError(f"checkpoint lacks '{prefix}.{missing[0]}' (each quantized projection of this "
                                  f"checkpoint needs {list(scheme.tensors)}; missing {missing})")
        try:
            return scheme.load(prefix, raw, shape)
        except ValueError as exc:  # a check of ops.quant_gemm's
            raise WeightLoadError(f"'{prefix}': {exc}") from exc

    def finish(self) -> None:
        """Check and convert everything collected (raises WeightLoadError naming the first bad tensor)."""
        for name, module in self.linears.items():
            shape = (module.out_features, module.in_features)
            module.raw = self._load(module.scheme, self._spelled(name, name), module.raw, shape)
        for name, module in self.experts.items():
            self._finish_experts(name, module)

    def _finish_experts(self, name: str, module: QuantExperts) -> None:
        fused = [proj for proj in ("gate_up_proj", "down_proj") if (name, proj) in self.fused]
        if fused and module.raw:
            raise WeightLoadError(f"'{name}' has both per-expert and fused ({fused[0]}) tensors")
        if fused:  # [E, ...] tensors: each expert's slice is one matrix of the per-expert layout
            for proj in ("gate_up_proj", "down_proj"):
                tensors = self.fused.pop((name, proj), {})
                spelled = f"{self._spelled((name, proj), name)}.{proj}"
                for suffix, tensor in tensors.items():
                    if tensor.dim() == 0 or tensor.shape[0] != module.num_experts:
                        raise WeightLoadError(f"fused expert tensor '{spelled}' ({suffix}) has shape "
                                              f"{list(tensor.shape)}; its first dimension must be the "
                                              f"{module.num_experts} experts")
                for e in range(module.num_experts):
                    part = {suffix: tensor[e] for suffix, tensor in tensors.items()}
                    module.raw[e, proj] = self._load(module.schemes[proj], f"{spelled}[{e}]", part,
                                                     module.projection_shape(proj))
            return
        for e in range(module.num_experts):
            for proj in _EXPERT_PROJECTIONS:
                spelled = self._spelled((name, e, proj), f"{name}.{e}.{proj}")
                module.raw[e, proj] = self._load(module.schemes[proj], spelled, module.raw.get((e, proj), {}),
                                                 module.projection_shape(proj))


@torch.no_grad()
def fill_dummy(model: nn.Module, generator: torch.Generator) -> None:
    """Random tensors in each quantized module's loaded layout (for --load-format dummy)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.raw = module.scheme.dummy((module.out_features, module.in_features), generator, module.device)
        elif isinstance(module, QuantExperts):
            for e in range(module.num_experts):
                for proj in _EXPERT_PROJECTIONS:
                    module.raw[e, proj] = module.schemes[proj].dummy(module.projection_shape(proj), generator,
                                                                     module.device)
