from megatron.core.models.multimodal.llava_model import LLaVAModel  # noqa: F401
