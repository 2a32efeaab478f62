"""par's own FP8 training (``[train].fp8 = tensorwise | rowwise | blockwise | mxfp8``): quantizers whose
scales do not depend on the layout, and the FP8 linear that uses them."""

from .grouped import FP8GroupedKernel, FP8GroupedLinear
from .param_gather import gather_bytes, gather_quantized
from .linear import FP8Linear, FP8LinearKernel, Sharding, fp8_gemm, fp8_linear
from .quantize import Quantized, check_aligned, quantize, recording, tile_amax
from .recipes import RECIPES, Recipe

__all__ = ["FP8GroupedKernel", "FP8GroupedLinear", "FP8Linear", "FP8LinearKernel", "Quantized", "RECIPES", "Recipe", "Sharding", "check_aligned",
           "fp8_gemm", "fp8_linear", "gather_bytes", "gather_quantized", "quantize", "recording", "tile_amax"]
