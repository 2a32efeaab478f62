"""DeepSeek-V3: multi-head latent attention (MLA, ``mla.py``) and its Hugging Face mapping (``hf.py``)."""

from .family import DeepSeek

FAMILY = DeepSeek()
