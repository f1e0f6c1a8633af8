"""Vision encoders: the CLIP / SigLIP ViT (`CLIPViTModel`), its layer specs and the projector that
maps image features into a language model's hidden size (`MultimodalProjector`)."""
