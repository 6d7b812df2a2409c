"""The cost model: TTFT, decode step and memory per rank of a context-parallel
layout, from a model's shape and a hardware profile (pure Python, no torch).
`ctxpar calibrate`'s measurements of a profile (hardware_calibration.py,
link_calibration.py, netns.py) are imported on their own: they run torch and
start processes."""

from ctxpar.costmodel.hardware import HardwareProfile, profile_from_dict
from ctxpar.costmodel.layout_estimates import DEFAULT_OUTPUT_TOKENS, Estimate, estimate, layouts
from ctxpar.costmodel.profiles import load_hardware
from ctxpar.costmodel.shapes import ModelShape, load_model_shape, shape_from_hf_config
from ctxpar.costmodel.timing import Breakdown

__all__ = [
    "DEFAULT_OUTPUT_TOKENS",
    "Breakdown",
    "Estimate",
    "HardwareProfile",
    "ModelShape",
    "estimate",
    "layouts",
    "load_hardware",
    "load_model_shape",
    "profile_from_dict",
    "shape_from_hf_config",
]
