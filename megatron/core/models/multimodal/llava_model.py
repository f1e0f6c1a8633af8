"""LLaVAModel: a CLIP ViT, a projector and a GPT language model (Megatron's
`megatron/core/models/multimodal/llava_model.py`).

Notation: b batch, s text length, S combined length, k tokens per image, h the LM hidden size.

Keys are the module paths, as in Megatron (no custom sharded state dict): `language_model.*`
(GPTModel), `vision_model.*` (CLIPViTModel), `vision_projection.encoder.*` (MultimodalProjector).
"""

import dataclasses
import logging
from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.multimodal.llava_inputs import (
    DEFAULT_IMAGE_TOKEN_INDEX,
    IGNORE_INDEX,
    count_placeholders,
    expand_placeholder_labels,
    merge_placeholder_batch,
    plan_placeholder_batch,
)
from megatron.core.models.vision.clip_vit_model import CLIPViTModel, get_num_image_embeddings
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

logger = logging.getLogger(__name__)


def vision_layers_for_feature_layer(num_layers: int, vision_feature_layer: int) -> int:
    """How many ViT layers produce HF's `hidden_states[vision_feature_layer]` (index 0 is the
    embedding output, -1 the last layer): the layers after it are never run, so not built."""
    kept = (
        vision_feature_layer if vision_feature_layer >= 0 else num_layers + 1 + vision_feature_layer
    )
    if not 1 <= kept <= num_layers:
        raise ValueError(
            f"LLaVA: vision_feature_layer {vision_feature_layer} selects no transformer layer of "
            f"the {num_layers}-layer vision model (use -{num_layers}..-1 or 1..{num_layers})"
        )
    return kept


class LLaVAModel(MegatronModule):
    """Images and text ids -> the language model's logits or per-token loss.

    Each image runs through `vision_model` ([b_img, c, H, W] -> [b_img, s_v, h_v]), optionally
    without its class token, then `vision_projection` (-> [b_img, k, h]); the image tokens join
    the text embeddings (llava_inputs.py) and the GPT decoder runs on the combined sequence.

    Tensor parallelism: the three parts share the LM's TP group. The ViT splits its layers as
    GPT does and replicates the patch embedding, class token and positions; the projector's fc1
    is column-parallel and fc2 row-parallel (forward all-reduce of its output; backward
    all-reduce of the gradient of its input, so the ViT sees the full gradient on every rank);
    the word embedding and output layer are split along the vocabulary as in GPTModel.

    Sequence parallelism (of the language model; the ViT and projector run without it, as in
    Megatron): the text embeddings are gathered back to the full sequence, the images merged in,
    and the combined sequence padded to a multiple of TP (zero embeddings, label IGNORE_INDEX,
    loss mask 0) and scattered over the TP group before the decoder; the outputs then have the
    padded length. It needs parallel_output=True, as in GPTModel.

    Pipeline parallelism (later Megatron's placement): the first stage (`pre_process`) holds
    the ViT, the projector, the word embedding and its share of the decoder layers, and builds
    the combined sequence; later stages hold only their decoder layers (GPTModel's layer
    offsets) and the last (`post_process`) the final norm, output layer and loss. The stages
    pass [S, b, h] (S/TP under sequence parallelism); S varies with the batch's images, so the
    caller's pipeline config needs `variable_seq_lengths`, or every batch must give the same S.
    The last stage rebuilds the expanded labels and loss mask from the ids and the image count
    (`expand_placeholder_labels`), which every stage's batch holds, so no labels travel.
    Tied embeddings across stages are GPTModel's (first and last stage copies, gradients
    all-reduced over the embedding group).

    Args:
        language_transformer_config (TransformerConfig): the LM's config.
        language_transformer_layer_spec (ModuleSpec): the LM's layer spec.
        language_vocab_size (int): padded vocabulary size.
        language_max_sequence_length (int): the combined sequence is cut to this length.
        vision_transformer_config (TransformerConfig): the ViT's config.
        vision_transformer_layer_spec (ModuleSpec): the ViT's layer spec.
        drop_vision_class_token (bool): drop the class tokens from the image features (HF's
            `vision_feature_select_strategy='default'`).
        vision_projection_config (TransformerConfig): the projector's config (hidden_size = the
            LM's, ffn_hidden_size its inner size).
        vision_projection_layer_spec (MLPSubmodules): the projector's linear layers.
        vision_projection_type (str): 'mlp' or 'affine'.
        allow_missing_vision_projection_checkpoint (bool): loading without
            `vision_projection.*` keys is not an error (a projector trained from scratch).
        parallel_output (bool): keep the logits split over the TP group.
        language_position_embedding_type (str): 'learned_absolute' (text positions only: an
            image counts as the one position of its placeholder) or 'rope' (over the combined
            sequence).
        language_rotary_percent (float): RoPE fraction.
        language_rotary_base (int): RoPE base.
        img_embedding_idx (int): where the image goes in r0.8's fixed-index mode (no placeholder
            in the batch).
        image_token_index (int): the placeholder id (later Megatron's; default -200).
        img_h, img_w, patch_dim (int): the image geometry (later Megatron's; r0.8 fixed 336/14).
        class_token_len (int): the ViT's class tokens.
        vision_feature_layer (int): which ViT output feeds the projector, in HF's numbering
            (-1 the last layer, -2 the one before; see `vision_layers_for_feature_layer`).
        supervise_first_token_after_image (bool): ours; give the first text token after each
            image loss mask 1 (HF LLaVA trains it, Megatron does not).
        pre_process (bool): this is the first pipeline stage (the embedding and the merge).
        post_process (bool): this is the last pipeline stage (the output layer and loss).
        add_encoder (bool, optional): build the ViT and projector here (default: pre_process;
            they can only live on the first stage).
        pg_collection (ProcessGroupCollection, optional): the LM's and ViT's groups.
    """

    def __init__(
        self,
        language_transformer_config: TransformerConfig,
        language_transformer_layer_spec: ModuleSpec,
        language_vocab_size: int,
        language_max_sequence_length: int,
        vision_transformer_config: TransformerConfig,
        vision_transformer_layer_spec: ModuleSpec,
        drop_vision_class_token: bool,
        vision_projection_config: TransformerConfig,
        vision_projection_layer_spec,
        vision_projection_type: str = "mlp",
        allow_missing_vision_projection_checkpoint: bool = False,
        parallel_output: bool = True,
        language_position_embedding_type: str = 'learned_absolute',
        language_rotary_percent: float = 1.0,
        language_rotary_base: int = 10000,
        img_embedding_idx: int = 0,
        image_token_index: int = DEFAULT_IMAGE_TOKEN_INDEX,
        img_h: int = 336,
        img_w: int = 336,
        patch_dim: int = 14,
        class_token_len: int = 1,
        vision_feature_layer: int = -1,
        supervise_first_token_after_image: bool = False,
        pre_process: bool = True,
        post_process: bool = True,
        add_encoder: Optional[bool] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=language_transformer_config)
        add_encoder = pre_process if add_encoder is None else add_encoder
        _check_layout(language_transformer_config, pre_process, add_encoder)
        logger.warning("LLaVA model is under development and may be missing features.")
        vision_transformer_config = _without_sequence_parallel(
            vision_transformer_config, 'Vision Transformer'
        )
        vision_projection_config = _without_sequence_parallel(
            vision_projection_config, 'Vision Projection'
        )
        vision_layers = vision_layers_for_feature_layer(
            vision_transformer_config.num_layers, vision_feature_layer
        )
        if vision_layers != vision_transformer_config.num_layers:
            vision_transformer_config = dataclasses.replace(
                vision_transformer_config, num_layers=vision_layers
            )

        self.model_type = ModelType.encoder_or_decoder
        self.img_embedding_idx = img_embedding_idx
        self.image_token_index = image_token_index
        self.drop_vision_class_token = drop_vision_class_token
        self.language_max_sequence_length = language_max_sequence_length
        self.supervise_first_token_after_image = supervise_first_token_after_image
        self.pre_process, self.post_process, self.add_encoder = (
            pre_process,
            post_process,
            add_encoder,
        )

        # The language model, the ViT and the projector draw their initial weights in this order.
        self.language_model = GPTModel(
            language_transformer_config,
            language_transformer_layer_spec,
            language_vocab_size,
            language_max_sequence_length,
            parallel_output=parallel_output,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            position_embedding_type=language_position_embedding_type,
            rotary_base=language_rotary_base,
            rotary_percent=language_rotary_percent,
        )
        self.vision_model = self.vision_projection = None
        if add_encoder:
            self.vision_model = CLIPViTModel(
                vision_transformer_config,
                _all_layers_here(vision_transformer_config, vision_transformer_layer_spec),
                class_token_len=class_token_len,
                patch_dim=patch_dim,
                img_h=img_h,
                img_w=img_w,
                pg_collection=pg_collection,
            )
            self.vision_projection = MultimodalProjector(
                vision_projection_config,
                vision_projection_layer_spec,
                vision_projection_type,
                vision_transformer_config.hidden_size,
            )
        #: Tokens one image (tile) contributes to the language model (every stage needs it to
        #: lay out the combined sequence).
        self.img_seq_len = get_num_image_embeddings(
            img_h, img_w, patch_dim, 'clip', drop_vision_class_token, class_token_len
        )
        if self.img_seq_len > language_max_sequence_length:
            raise ValueError(
                f"LLaVA: language_max_sequence_length {language_max_sequence_length} is shorter "
                f"than the {self.img_seq_len} tokens of one image"
            )
        if allow_missing_vision_projection_checkpoint:
            self.register_load_state_dict_post_hook(_ignore_missing_projection)

    def set_input_tensor(self, input_tensor) -> None:
        """The previous stage's [S, b, h] goes to the language model's decoder (the ViT runs
        on the first stage, which receives nothing)."""
        self.language_model.set_input_tensor(input_tensor)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """The language model's tie (finalize_model_grads reads it on this module)."""
        return self.language_model.share_embeddings_and_output_weights

    def ties_word_embedding_across_stages(self) -> bool:
        """Whether the first and last stages hold word-table copies kept equal (GPTModel's)."""
        return self.language_model.ties_word_embedding_across_stages()

    def shared_embedding_or_output_weight(self):
        """This stage's copy of the tied word table (GPTModel's), or None."""
        return self.language_model.shared_embedding_or_output_weight()

    def freeze(
        self,
        freeze_language_model: bool,
        freeze_vision_model: bool,
        freeze_vision_projection: bool,
    ) -> None:
        """Stop the gradients of the chosen parts (requires_grad=False on their parameters)."""
        chosen = [
            (self.language_model, freeze_language_model),
            (self.vision_model, freeze_vision_model),
            (self.vision_projection, freeze_vision_projection),
        ]
        for module, frozen in chosen:
            # Under pipeline parallelism a later stage holds no vision part.
            if frozen and module is not None:
                for param in module.parameters():
                    param.requires_grad = False

    def image_embeddings(self, images: Tensor) -> Tensor:
        """Images [n, c, H, W] -> projected tokens [n, k, h]."""
        if self.vision_model is None:
            raise ValueError(
                "LLaVA: images were given to a model built without its vision encoder "
                "(add_encoder=False)"
            )
        features = self.vision_model(images)  # [n, s_v, h_v]
        if self.drop_vision_class_token:
            features = features[:, self.vision_model.class_token_len :]  # [n, k, h_v]
        return self.vision_projection(features)  # [n, k, h]

    def forward(
        self,
        images: Optional[Tensor],
        input_ids: Tensor,
        position_ids: Optional[Tensor],
        attention_mask: Optional[Tensor],
        labels: Optional[Tensor] = None,
        loss_mask: Optional[Tensor] = None,
        inference_params=None,
        num_image_tiles: Optional[Tensor] = None,
        image_token_index: Optional[int] = None,
    ):
        """Run the model.

        Placeholder mode (some id equals `image_token_index`): each placeholder becomes its
        image's tiles' tokens, labels and loss mask are expanded (llava_inputs.py) and the
        attention is causal (`attention_mask` is not used, as in Megatron, which assumes a
        causal LM). Fixed-index mode (r0.8; images but no placeholder): one image per sample is
        inserted before text position `img_embedding_idx`; labels, loss mask and attention mask
        must already have the combined length. Text only: no images and no placeholder.

        Args:
            images: [n_tiles, c, H, W] or None.
            input_ids: [b, s].
            position_ids: [b, s] text positions (learned absolute); None = 0..s-1.
            attention_mask: see above.
            labels, loss_mask: [b, s] (fixed-index mode: [b, S]) or None.
            inference_params (InferenceParams): KV-cache decoding. The prompt step runs the
                images; later steps (`sequence_len_offset` > 0) feed text only and `images` is
                ignored, since the image tokens are already in the cache (r0.8 skips the ViT
                then too). Default positions continue from the offset, which is right for RoPE;
                learned absolute positions count text only, so pass them. Prompts of different
                combined lengths are right-padded, so batch only equal-length prompts.
            num_image_tiles: [n_img] tiles per image (None: one each).
            image_token_index: overrides the constructor's placeholder id.

        Returns:
            (the loss [b, S] with labels, else logits [b, S, v/p]; the loss mask [b, S] or None);
            S is padded to a multiple of TP under sequence parallelism.
        """
        if not self.pre_process:
            return self._later_stage_forward(
                images, input_ids, labels, loss_mask, inference_params, num_image_tiles,
                image_token_index,
            )  # fmt: skip
        offset = 0
        if inference_params is not None and inference_params.sequence_len_offset > 0:
            images, offset = None, inference_params.sequence_len_offset
        token = self.image_token_index if image_token_index is None else image_token_index
        n_tiles = 0 if images is None else images.shape[0]
        placeholder_mode = n_tiles == 0 or bool(count_placeholders(input_ids, token).sum() > 0)
        if placeholder_mode:
            # Every check before any work (merge_placeholder_batch repeats it).
            plan_placeholder_batch(
                input_ids, n_tiles, self.img_seq_len, num_image_tiles, token,
                self.language_max_sequence_length,
            )  # fmt: skip
        if position_ids is None:
            s = input_ids.shape[1]
            position_ids = torch.arange(offset, offset + s, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)  # [b, s]
        text = self._text_embeddings(input_ids.masked_fill(input_ids == token, 0), position_ids)

        if placeholder_mode:
            image_tokens = self.image_embeddings(images) if n_tiles else None
            combined, labels, loss_mask = merge_placeholder_batch(
                text, image_tokens, input_ids, num_image_tiles, token,
                self.language_max_sequence_length, labels, loss_mask,
                self.supervise_first_token_after_image,
            )  # fmt: skip
            attention_mask = None
            if n_tiles == 0 and torch.is_grad_enabled() and self.add_encoder:
                combined = combined + self._zero_anchor()
        else:
            combined = self._fixed_index(text, images, labels, loss_mask)
        if self.config.sequence_parallel:
            combined, labels, loss_mask = self._scatter(combined, labels, loss_mask)
        output = self.language_model(
            None,
            None,
            attention_mask,
            decoder_input=combined,
            labels=labels,
            inference_params=inference_params,
        )
        return output, loss_mask

    def _later_stage_forward(
        self, images, input_ids, labels, loss_mask, inference_params, num_image_tiles,
        image_token_index,
    ):  # fmt: skip
        """A stage after the first: the decoder runs on the received [S, b, h]; the last stage
        rebuilds the expanded labels and loss mask (the first stage's, from the ids and the
        image count) for its loss. Middle stages need no batch (all of it may be None)."""
        if self.post_process and input_ids is not None:
            token = self.image_token_index if image_token_index is None else image_token_index
            n_tiles = 0 if images is None else images.shape[0]
            if n_tiles == 0 or bool(count_placeholders(input_ids, token).sum() > 0):
                labels, loss_mask = expand_placeholder_labels(
                    input_ids, n_tiles, self.img_seq_len, num_image_tiles, token,
                    self.language_max_sequence_length, labels, loss_mask,
                    self.supervise_first_token_after_image,
                )  # fmt: skip
            # Fixed-index mode: the labels and mask already have the combined length.
            if self.config.sequence_parallel:
                labels, loss_mask = _pad_targets(
                    labels, loss_mask, self.config.tensor_model_parallel_size
                )
        output = self.language_model(
            None,
            None,
            None,
            decoder_input=None,
            labels=labels if self.post_process else None,
            inference_params=inference_params,
        )
        return output, loss_mask

    def _zero_anchor(self):
        """0 x every trainable vision and projector parameter: a text-only batch still gives
        them (zero) gradients, so the data-parallel gradient reduction sees every parameter on
        every rank (later Megatron anchors text-only batches the same way)."""
        params = [
            p
            for module in (self.vision_model, self.vision_projection)
            for p in module.parameters()
            if p.requires_grad
        ]
        return sum(p.sum() for p in params) * 0.0 if params else 0.0

    def _text_embeddings(self, ids: Tensor, position_ids: Tensor) -> Tensor:
        """[b, s] -> [s, b, h], the whole sequence on every rank. Under sequence parallelism
        the embedding scatters its output: the text is padded to a multiple of TP first and the
        pieces gathered back (backward: each rank keeps its slice of the replicated gradient)."""
        if not self.config.sequence_parallel:
            return self.language_model.embedding(input_ids=ids, position_ids=position_ids)
        s = ids.shape[1]
        pad = -s % self.config.tensor_model_parallel_size
        ids = torch.nn.functional.pad(ids, (0, pad))  # [b, s + pad]
        position_ids = torch.nn.functional.pad(position_ids, (0, pad))
        text = self.language_model.embedding(input_ids=ids, position_ids=position_ids)
        text = tensor_parallel.gather_from_sequence_parallel_region(
            text, tensor_parallel_output_grad=False, group=self.language_model.pg_collection.tp
        )  # [(s + pad)/p, b, h] -> [s + pad, b, h]
        return text[:s]

    def _scatter(self, combined: Tensor, labels, loss_mask):
        """Sequence parallelism: pad the combined sequence [S, b, h] to a multiple of TP (zero
        embeddings, label IGNORE_INDEX, mask 0) and give each rank its [S/p, b, h] slice."""
        pad = -combined.shape[0] % self.config.tensor_model_parallel_size
        if pad:
            combined = torch.nn.functional.pad(combined, (0, 0, 0, 0, 0, pad))  # [S + pad, b, h]
        labels, loss_mask = _pad_targets(labels, loss_mask, self.config.tensor_model_parallel_size)
        combined = tensor_parallel.scatter_to_sequence_parallel_region(
            combined, group=self.language_model.pg_collection.tp
        )
        return combined, labels, loss_mask

    def _fixed_index(self, text: Tensor, images: Tensor, labels, loss_mask) -> Tensor:
        """r0.8: [text[:idx]; image; text[idx:]] for one image per sample. text [s, b, h]."""
        s, b = text.shape[0], text.shape[1]
        idx = self.img_embedding_idx
        if images.shape[0] != b:
            raise ValueError(
                f"LLaVA: {images.shape[0]} images for {b} samples without image tokens "
                f"({self.image_token_index}) in input_ids: fixed-index mode takes one per sample"
            )
        if not 0 <= idx <= s:
            raise ValueError(f"LLaVA: img_embedding_idx {idx} is outside the {s} text tokens")
        for name, t in (('labels', labels), ('loss_mask', loss_mask)):
            if t is not None and t.shape[1] != s + self.img_seq_len:
                raise ValueError(
                    f"LLaVA fixed-index mode: {name} has {t.shape[1]} positions, the combined "
                    f"sequence {s + self.img_seq_len} ({s} text + {self.img_seq_len} image tokens)"
                )
        image = self.image_embeddings(images).transpose(0, 1)  # [b, k, h] -> [k, b, h]
        return torch.cat([text[:idx], image, text[idx:]], dim=0)  # [S, b, h]


def _pad_targets(labels, loss_mask, tp: int):
    """Labels [b, S] and loss mask [b, S] padded to a multiple of TP (IGNORE_INDEX, 0)."""
    if labels is not None:
        labels = torch.nn.functional.pad(labels, (0, -labels.shape[1] % tp), value=IGNORE_INDEX)
    if loss_mask is not None:
        loss_mask = torch.nn.functional.pad(loss_mask, (0, -loss_mask.shape[1] % tp))
    return labels, loss_mask


def _check_layout(config: TransformerConfig, pre_process: bool, add_encoder: bool) -> None:
    """The parallel layouts this model supports (one line each)."""
    if add_encoder and not pre_process:
        raise ValueError(
            "LLaVA: the vision encoder can only live on the first pipeline stage "
            "(add_encoder=True needs pre_process=True)"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            "LLaVA: context parallelism is not supported yet "
            f"(--context-parallel-size {config.context_parallel_size})"
        )


def _all_layers_here(config: TransformerConfig, spec):
    """The ViT's block spec with every one of its layers: the ViT is not split over the
    pipeline (a layer spec alone would give this stage num_layers / PP of them)."""
    if isinstance(spec, ModuleSpec) and issubclass(spec.module, BaseTransformerLayer):
        return TransformerBlockSubmodules(
            layer_specs=[spec] * config.num_layers, layer_norm=WrappedTorchNorm
        )
    return spec


def _without_sequence_parallel(config: TransformerConfig, part: str) -> TransformerConfig:
    """The vision parts run on the whole image sequence, as in Megatron."""
    if not config.sequence_parallel:
        return config
    logger.warning(f"> Disabling Sequence parallelism in {part}. Not yet supported")
    return dataclasses.replace(config, sequence_parallel=False)


def _ignore_missing_projection(module, incompatible_keys) -> None:
    """Load post-hook: a checkpoint without the projector is not an error."""
    for key in list(incompatible_keys.missing_keys):
        if 'vision_projection.' in key:
            logger.warning(f"{key} being removed from incompatible_keys.missing_keys in LlavaModel")
            incompatible_keys.missing_keys.remove(key)
