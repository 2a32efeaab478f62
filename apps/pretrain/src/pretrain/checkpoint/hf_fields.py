"""The Hugging Face config fields' helpers live with the families that use them (``pretrain.models.hf_fields``);
their names stay importable from here."""

from ..models.hf_fields import *  # noqa: F401,F403
from ..models.hf_fields import MISSING, read_config_json  # noqa: F401
