"""gpt-oss (transformers' ``gpt_oss``): sliding-window and full attention alternating, attention sinks, biased MoE."""

from .family import GptOss

FAMILY = GptOss()
