"""The models of Megatron's legacy vision scripts (classification, inpainting), built here on the
megatron.core ViT (`megatron.core.models.vision.clip_vit_model.CLIPViTModel`)."""
