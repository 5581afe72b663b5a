"""unikv's model implementations (on unikv's own layers) and checkpoint loading."""

from unikv.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, model_config_from_hf
from unikv.models.llama import CausalLM
from unikv.models.loader import load_model, load_model_config, load_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "model_config_from_hf",
]
