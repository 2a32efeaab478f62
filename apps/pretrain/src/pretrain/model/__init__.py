"""The Llama/DeepSeek-style model: single-device reference, its parallel composition, and the GPU kernels it runs."""
