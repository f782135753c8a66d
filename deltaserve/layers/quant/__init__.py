"""Quantized checkpoints: one module per family, each naming its tensors, what stays bf16 and its kernel calls.

    detect.py     which family a checkpoint is (config.json quantization_config, hf_quant_config.json) and
                  whether --quantization agrees: a WeightFormat, or None for bf16 weights
    scheme.py     WeightFormat (which projections a checkpoint quantizes, and how) and Scheme (one kind of
                  quantized matrix: its tensors, checks, joins, preparation, dummy values, bytes)
    weight.py     QuantWeight / SplitWeight: what a projection multiplies by once loaded
    fp8.py        Qwen's FP8 (e4m3, 128 x 128 block scales, W8A8) and online FP8 of a bf16 checkpoint
    int4.py       compressed-tensors pack-quantized int4 W4A16
    awq_gptq.py   AutoAWQ and GPTQ, converted at load into compressed-tensors' layout
    nvfp4.py      ModelOpt NVFP4, weight-only

The layers never ask which family they hold: a quantized projection is a QuantLinear (layers/linear.py) with a
Scheme, routed experts a QuantExperts (layers/mlp.py), and ops.linear multiplies whatever weight it is given.
"""

from deltaserve.layers.quant.detect import FLAG_METHODS, detect_weight_format
from deltaserve.layers.quant.scheme import Scheme, WeightFormat
from deltaserve.layers.quant.weight import QuantWeight, SplitWeight

__all__ = ["FLAG_METHODS", "QuantWeight", "Scheme", "SplitWeight", "WeightFormat", "detect_weight_format"]
