"""`DynamicInferenceContext`: the paged KV cache of the dynamic engine and the layout of one packed
step.

Memory: per self-attention layer of this pipeline stage, a key pool and a value pool of
[num_blocks, B, ng/tp, hn] (B = block_size_tokens tokens per block, ng query groups, hn head
size), allocated on the layer's first step. Keys are stored after RoPE. Multi-latent attention
layers (an MLATransformerConfig) instead keep a latent pool [num_blocks * B, rkv] and a rotary
key pool [num_blocks * B, dr] (the normalised latent and the rotated shared rotary key, whole on
every tensor-parallel rank), re-expanded per step by the layer (`latent_attention`). A request
owns ceil(tokens cached / B) blocks, taken from `KVBlockAllocator` as it grows and given back
when it finishes or is preempted. Recurrent layers (the Mamba mixers of a hybrid model) keep a
fixed-size state per request instead: a request also holds one of `max_requests` state slots
(`request_slot`) from its first step until it finishes or is preempted (a preempted request is
recomputed from position 0, so its state restarts from zero).

Step layout (`build_step`): the scheduled requests' new tokens are packed into one sequence
[1, T] (decode tokens and prompt chunks alike), with their own positions. The model runs with this
context as `inference_params`:
- each self-attention layer calls `attention()` (the hook in
  `megatron/core/transformer/attention.py`): RoPE by packed position, keys / values written to
  their slots, then `paged_attention` per request;
- the output layer calls `select_logit_positions()` (the hook in GPTModel) so that logits are
  computed only where the engine needs them (each sampling request's last token, and every prompt
  position of requests that asked for prompt log probs).
"""

import math
from typing import Dict, List, NamedTuple, Optional

import torch

from megatron.core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron.core.inference.contexts.paged_attention import (
    paged_attention,
    write_to_paged_cache,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.utils import get_current_device

#: later megatron-core's default of --inference-dynamic-batching-max-tokens.
DEFAULT_MAX_TOKENS = 16384


class StepChunk(NamedTuple):
    """One request's part of a packed step.

    Attributes:
        request_id (str): the request.
        token_ids (list of int): its new tokens (one decode token, or a prompt chunk).
        start_position (int): position of the first of them (= tokens already cached).
        logits (str): "none", "last" (the last token's, to sample from) or "all".
    """

    request_id: str
    token_ids: List[int]
    start_position: int
    logits: str


class DynamicInferenceContext:
    """Paged KV cache plus the current step's packing.

    Args:
        model_config (TransformerConfig): the model's config (layers, heads, groups, head size,
            params_dtype; tensor / pipeline sizes unless pg_collection says otherwise).
        max_sequence_length (int): longest request (prompt + generated tokens).
        buffer_size_gb (float): KV cache memory of this rank, in GiB (keys and values of all its
            layers); sets the number of blocks. Ignored when num_blocks is given.
        block_size_tokens (int): tokens per block.
        max_requests (int, optional): most requests holding KV blocks at once (default: the
            number of blocks, at most max_tokens and 256).
        max_tokens (int, optional): most tokens in one packed step (default 16384).
        num_blocks (int, optional): the number of blocks, instead of buffer_size_gb.
        pg_collection (ProcessGroupCollection, optional): tp / pp groups (default: global).
        num_kv_layers (int, optional): self-attention layers per pipeline stage that hold a KV
            cache, the same on every rank (default: ceil(num_layers / pp); a hybrid Mamba model
            has fewer: its most on any stage, at least 1). Sizes the blocks.
    """

    def __init__(
        self,
        model_config,
        max_sequence_length: int,
        buffer_size_gb: float = 1.0,
        block_size_tokens: int = 256,
        max_requests: Optional[int] = None,
        max_tokens: Optional[int] = None,
        num_blocks: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        num_kv_layers: Optional[int] = None,
    ):
        pgs = resolve_process_groups(pg_collection, ("tp", "pp"))
        tp, pp = pgs.tp.size(), pgs.pp.size()
        if block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be at least 1, got {block_size_tokens}")
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be at least 2, got {max_sequence_length}")
        self.config = model_config
        self.max_sequence_length = max_sequence_length
        self.block_size_tokens = block_size_tokens
        self.num_query_groups_per_partition = model_config.num_query_groups // tp
        self.head_dim = model_config.kv_channels
        if num_kv_layers is None:
            num_kv_layers = math.ceil(model_config.num_layers / pp)
        self.num_local_layers = max(1, num_kv_layers)
        dtype = model_config.params_dtype
        if getattr(model_config, "multi_latent_attention", False):
            # Per token and layer: the latent and the rotary key, not divided by tp.
            values_per_token = model_config.kv_lora_rank + model_config.qk_pos_emb_head_dim
        else:
            values_per_token = 2 * self.num_query_groups_per_partition * self.head_dim
        self.block_size_bytes = (
            self.num_local_layers
            * block_size_tokens
            * values_per_token
            * torch.empty((), dtype=dtype).element_size()
        )
        if num_blocks is None:
            num_blocks = int(buffer_size_gb * 1024**3) // self.block_size_bytes
            if num_blocks < 1:
                raise ValueError(
                    f"KV cache buffer of {buffer_size_gb} GiB holds no block of "
                    f"{self.block_size_bytes} bytes ({block_size_tokens} tokens); raise "
                    "--inference-dynamic-batching-buffer-size-gb or lower the block size"
                )
        self.block_allocator = KVBlockAllocator(num_blocks)
        self.num_blocks = num_blocks
        self.max_tokens = max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS
        if max_requests is None:
            max_requests = min(num_blocks, self.max_tokens, 256)
        self.max_requests = max_requests
        if self.max_requests < 1 or self.max_tokens < 1:
            raise ValueError(
                f"max_requests ({self.max_requests}) and max_tokens ({self.max_tokens}) must be "
                "at least 1"
            )
        if self.max_tokens < self.max_requests:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be at least max_requests "
                f"({self.max_requests}): every active request decodes one token per step"
            )
        self.memory: Dict[int, tuple] = {}
        # Recurrent (Mamba) layers: one state row per running request, not paged.
        self.mamba_memory: Dict[int, tuple] = {}
        self.request_slot: Dict[str, int] = {}
        self._free_slots: List[int] = list(range(self.max_requests - 1, -1, -1))
        self.request_blocks: Dict[str, List[int]] = {}
        self.request_kv_length: Dict[str, int] = {}
        # Static-cache fields the model may read.
        self.sequence_len_offset = 0
        self.materialize_only_last_token_logits = False
        self._clear_step()

    # ------------------------------------------------------------------ kind
    def is_static_batching(self) -> bool:
        return False

    def is_dynamic_batching(self) -> bool:
        return True

    # ------------------------------------------------------------------ blocks
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size_tokens)

    def blocks_needed(self, request_id: str, kv_length: int) -> int:
        """More blocks `request_id` needs to hold `kv_length` tokens."""
        have = len(self.request_blocks.get(request_id, ()))
        return max(0, self.blocks_for(kv_length) - have)

    def grow(self, request_id: str, kv_length: int) -> bool:
        """Give `request_id` room for `kv_length` tokens; False (nothing taken) if the pool is
        short."""
        need = self.blocks_needed(request_id, kv_length)
        new_request = request_id not in self.request_slot
        if new_request and not self._free_slots:
            return False
        blocks = self.block_allocator.allocate_memory_blocks(need)
        if blocks is None:
            return False
        if new_request:
            self.request_slot[request_id] = self._free_slots.pop()
        self.request_blocks.setdefault(request_id, []).extend(blocks)
        self.request_kv_length.setdefault(request_id, 0)
        return True

    def release(self, request_id: str) -> None:
        """Free every block of `request_id` (finished, cancelled or preempted)."""
        blocks = self.request_blocks.pop(request_id, [])
        self.request_kv_length.pop(request_id, None)
        slot = self.request_slot.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self.block_allocator.release_memory_blocks(blocks)

    def kv_length(self, request_id: str) -> int:
        """Tokens of `request_id` in the cache."""
        return self.request_kv_length.get(request_id, 0)

    def _layer_pools(self, layer_number: int, like: torch.Tensor):
        if layer_number not in self.memory:
            shape = (
                self.num_blocks,
                self.block_size_tokens,
                self.num_query_groups_per_partition,
                self.head_dim,
            )
            self.memory[layer_number] = (
                torch.empty(shape, dtype=like.dtype, device=like.device),
                torch.empty(shape, dtype=like.dtype, device=like.device),
            )
        return self.memory[layer_number]

    # ------------------------------------------------------------------ step layout
    def _clear_step(self):
        self.step_chunks: List[StepChunk] = []
        self.step_input_ids = None
        self.step_position_ids = None
        self.slot_mapping = None
        self.attention_requests = []
        self.attention_slots = None
        self.logit_positions = None
        self.logit_slices: Dict[str, tuple] = {}
        self.mamba_decode_rows = None
        self.mamba_chunk_rows: List[tuple] = []

    def build_step(self, chunks: List[StepChunk]) -> None:
        """Pack `chunks` (each request's blocks already grown to hold them) into this step's
        inputs: input ids and positions [1, T], the slot of every token, each request's rows and
        block table, and the logit positions."""
        device = get_current_device()
        B = self.block_size_tokens
        ids, positions, slots, logit_positions = [], [], [], []
        key_slots, request_slots, spans = [], [], []
        self.attention_requests = []
        self.logit_slices = {}
        for chunk in chunks:
            blocks = self.request_blocks[chunk.request_id]
            q_start = len(ids)
            n = len(chunk.token_ids)
            kv_len = chunk.start_position + n
            assert self.blocks_for(kv_len) <= len(blocks), "grow() the request first"
            ids.extend(chunk.token_ids)
            span = range(chunk.start_position, kv_len)
            positions.extend(span)
            slots.extend(blocks[p // B] * B + p % B for p in span)
            # The slots of all the request's keys (one tensor for the whole step, made below).
            request_slots.append(len(key_slots))
            key_slots.extend(blocks[p // B] * B + p % B for p in range(kv_len))
            spans.append((q_start, q_start + n, kv_len))
            first = len(logit_positions)
            if chunk.logits == "last":
                logit_positions.append(q_start + n - 1)
            elif chunk.logits == "all":
                logit_positions.extend(range(q_start, q_start + n))
            self.logit_slices[chunk.request_id] = (first, len(logit_positions))
            self.request_kv_length[chunk.request_id] = kv_len
        self.step_chunks = list(chunks)
        self.step_input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        self.step_position_ids = torch.tensor([positions], dtype=torch.long, device=device)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        self.logit_positions = torch.tensor(logit_positions, dtype=torch.long, device=device)
        # Every request's key slots, gathered once per layer by `paged_attention`; a request's
        # own are a view of them.
        self.attention_slots = torch.tensor(key_slots, dtype=torch.long, device=device)
        self.attention_requests = [
            (q_start, q_end, kv_len, self.attention_slots[first : first + kv_len])
            for (q_start, q_end, kv_len), first in zip(spans, request_slots)
        ]
        if not self.attention_requests:
            self.attention_slots = None
        self._build_recurrent_rows(chunks, spans, device)

    def _build_recurrent_rows(self, chunks, spans, device):
        """The step's rows for recurrent layers: continuing requests with one new token are
        stepped together (`mamba_decode_rows` = (packed positions [n], state slots [n])); every
        other chunk (a prompt, a prompt chunk, a first token) is scanned on its own from its
        request's state (`mamba_chunk_rows`: (q_start, q_end, slot, fresh)), fresh = it starts
        at position 0, so the state starts from zero."""
        positions, slots, self.mamba_chunk_rows = [], [], []
        for chunk, (q_start, q_end, _) in zip(chunks, spans):
            slot = self.request_slot[chunk.request_id]
            fresh = chunk.start_position == 0
            if q_end - q_start == 1 and not fresh:
                positions.append(q_start)
                slots.append(slot)
            else:
                self.mamba_chunk_rows.append((q_start, q_end, slot, fresh))
        self.mamba_decode_rows = (
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(slots, dtype=torch.long, device=device),
        )

    # ------------------------------------------------------------------ model hooks
    def attention(self, layer_number, query, key, value, rotary_pos_emb, config) -> torch.Tensor:
        """Self attention of the packed step for layer `layer_number`.

        Args:
            query: [T, 1, np, hn]; key, value: [T, 1, ng, hn] (this rank's heads).
            rotary_pos_emb: RoPE angles of positions 0..max_sequence_length - 1 ([S, 1, 1, d],
                or a (query, key) pair), or None.
            config (TransformerConfig): the layer's config (RoPE layout).

        Returns:
            context [T, 1, np * hn].
        """
        if rotary_pos_emb is not None:
            if not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
            positions = self.step_position_ids[0]
            q_emb = rotary_pos_emb[0].index_select(0, positions)  # [T, 1, 1, d]
            k_emb = rotary_pos_emb[1].index_select(0, positions)
            query = apply_rotary_pos_emb(query, q_emb, config=config)
            key = apply_rotary_pos_emb(key, k_emb, config=config)
        key_pool, value_pool = self._layer_pools(layer_number, key)
        write_to_paged_cache(key, value, key_pool, value_pool, self.slot_mapping)
        return paged_attention(
            query, key_pool, value_pool, self.attention_requests, all_slots=self.attention_slots
        )

    def latent_attention(
        self, layer_number, query, latent, k_pos, expand, softmax_scale
    ) -> torch.Tensor:
        """Multi-latent self attention of the packed step for layer `layer_number`: this step's
        latents and rotary keys go to their slots, every scheduled request's cached ones are
        gathered once and expanded to keys / values by `expand` (the layer's up projection), then
        each request attends over its own.

        Args:
            query: [T, 1, np, dn + dr] (rotated).
            latent: [T, 1, rkv] (normalised); k_pos: [T, 1, 1, dr] (rotated).
            expand: (latent [N, 1, rkv], k_pos [N, 1, 1, dr]) -> (keys [N, 1, np, dn + dr],
                values [N, 1, np, dv]).
            softmax_scale: the layer's logit scale.

        Returns:
            context [T, 1, np * dv].
        """
        rkv, dr = latent.size(-1), k_pos.size(-1)
        if layer_number not in self.memory:
            pool = (self.num_blocks * self.block_size_tokens,)
            self.memory[layer_number] = (
                latent.new_empty(pool + (rkv,)),
                k_pos.new_empty(pool + (dr,)),
            )
        latent_pool, k_pos_pool = self.memory[layer_number]  # [slots, rkv], [slots, dr]
        latent_pool.index_copy_(0, self.slot_mapping, latent.reshape(-1, rkv))
        k_pos_pool.index_copy_(0, self.slot_mapping, k_pos.reshape(-1, dr))
        slots = self.attention_slots
        cached_latent = latent_pool.index_select(0, slots).unsqueeze(1)  # [N, 1, rkv]
        cached_k_pos = k_pos_pool.index_select(0, slots)[:, None, None, :]  # [N, 1, 1, dr]
        keys, values = expand(cached_latent, cached_k_pos)  # [N, 1, np, dn + dr], [N, 1, np, dv]
        # The expanded rows are already in request order: pools of one-token blocks, read in
        # sequence (the gather in paged_attention is then a plain copy).
        order = torch.arange(slots.numel(), device=slots.device)
        return paged_attention(
            query,
            keys.view(-1, 1, keys.size(-2), keys.size(-1)),
            values.view(-1, 1, values.size(-2), values.size(-1)),
            self.attention_requests,
            softmax_scale=softmax_scale,
            all_slots=order,
        )

    def mamba_states(self, layer_number, conv_shape, conv_dtype, ssm_shape, device):
        """(conv states [max_requests, *conv_shape], SSM states [max_requests, *ssm_shape] fp32)
        of recurrent layer `layer_number`, one row per request slot (`request_slot`); allocated
        (zeros) on the layer's first step. Their memory is not part of buffer_size_gb."""
        if layer_number not in self.mamba_memory:
            rows = self.max_requests
            self.mamba_memory[layer_number] = (
                torch.zeros((rows,) + tuple(conv_shape), dtype=conv_dtype, device=device),
                torch.zeros((rows,) + tuple(ssm_shape), dtype=torch.float32, device=device),
            )
        return self.mamba_memory[layer_number]

    def select_logit_positions(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, 1, h] -> [N, 1, h]: the positions whose logits the engine needs."""
        return hidden_states.index_select(0, self.logit_positions)
