"""The Llama/DeepSeek-style model: single-device reference and its parallel composition."""
