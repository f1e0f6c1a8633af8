"""megatron.core.transformer: config, layers, attention, MLP and block built from module specs."""

from .module import MegatronModule
from .spec_utils import ModuleSpec, build_module
from .transformer_config import TransformerConfig
from .transformer_layer import TransformerLayer, TransformerLayerSubmodules
