"""ModelParallelConfig: the parallelism and training options every megatron.core module reads."""

from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional

import torch


@dataclass
class ModelParallelConfig:
    """Base configuration for megatron.core (TransformerConfig extends it).

    Core modules read it and never modify it. Fields that select Transformer Engine kernels
    (`tp_comm_atomic_*`, `use_te_rng_tracker`) are accepted for compatibility and have no effect
    here; the `tp_comm_*` overlap switches drive `tensor_parallel/comm_overlap.py`.
    """

    ###################
    # Model parallelism
    ###################
    tensor_model_parallel_size: int = 1
    """Intra-layer model parallelism: splits tensors across this many ranks."""

    context_parallel_size: int = 1
    """Splits the network input (sequence) across this many ranks inside attention."""

    hierarchical_context_parallel_sizes: Optional[List[int]] = None
    """Two sizes whose product is context_parallel_size, for cp_comm_type 'a2a+p2p': all-to-all
    inside level-0 groups of the first size (contiguous CP ranks), ring across level-1 groups of
    the second size."""

    pipeline_model_parallel_size: int = 1
    """Inter-layer model parallelism: splits transformer layers across this many stages."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline stage (interleaved 1F1B schedule); None disables it."""

    sequence_parallel: bool = False
    """With tensor parallelism, also splits layer-norm and dropout activations along the
    sequence dimension (all-gather before, reduce-scatter after the tensor parallel region).
    See "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198)."""

    expert_model_parallel_size: int = 1
    """Distributes MoE experts across this many ranks (a sub-division of data parallelism)."""

    moe_extended_tp: bool = False
    """Alternative MoE parallelism that shards expert weights over tensor x expert ranks."""

    ###################
    # Initialization
    ###################
    perform_initialization: bool = True
    """If False, parameters are allocated but not initialized (e.g. when loading a checkpoint)."""

    use_cpu_initialization: bool = False
    """Build the full (master) weights on CPU with the global seed and keep each rank's slice, so
    that a model built at TP=k holds exactly the slices of the TP=1 weights. If False, each
    partition is initialized directly on the device under the model-parallel RNG."""

    ###################
    # Training
    ###################
    fp16: bool = False
    """Train with fp16 mixed precision."""

    bf16: bool = False
    """Train with bf16 mixed precision."""

    params_dtype: torch.dtype = torch.float32
    """dtype of the weights when they are allocated."""

    timers: Callable = None
    """Timers object (megatron.core.timers.Timers) used to time parts of the step; optional."""

    finalize_model_grads_func: Callable = None
    """Called by the pipeline schedules once all microbatches are done: reduces gradients across
    data parallel ranks, embedding groups, sequence-parallel layer norms."""

    grad_scale_func: Callable = None
    """Multiplies the loss before backward (loss scaling); None means no scaling."""

    no_sync_func: Callable = None
    """Context manager that disables gradient synchronization (DDP's no_sync); a list of them
    with virtual pipeline parallelism."""

    grad_sync_func: Callable = None
    """Starts the gradient reduce-scatter / all-reduce of a model chunk (overlapped with the
    pipeline's backward); a list with virtual pipeline parallelism."""

    param_sync_func: Callable = None
    """Starts the parameter all-gather of a model chunk (distributed optimizer overlap); a list
    with virtual pipeline parallelism."""

    deterministic_mode: bool = False
    """Use only deterministic algorithms (torch.use_deterministic_algorithms)."""

    enable_autocast: bool = False
    """Run the model forward under torch.autocast."""

    autocast_dtype: torch.dtype = None
    """dtype of torch.autocast; defaults to params_dtype."""

    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    """With recompute_num_layers, how many microbatches of a step checkpoint only part of the
    layers (the rest are recomputed fully); None checkpoints every microbatch the same way."""

    ###################
    # Optimizations
    ###################
    gradient_accumulation_fusion: bool = False
    """Accumulate weight gradients straight into `param.main_grad` (fp32) in the backward of the
    linear layers instead of producing `param.grad`. Needs parameters with `main_grad` (DDP)."""

    async_tensor_model_parallel_allreduce: bool = False
    """Overlap the input-gradient all-reduce of ColumnParallelLinear with the weight-gradient
    computation. Disabled automatically with sequence_parallel."""

    use_te_rng_tracker: bool = False
    """Use Transformer Engine's RNG tracker; accepted, no effect here."""

    tp_comm_overlap: bool = False
    """With sequence_parallel, pipeline the linear layers' sequence all-gather / reduce-scatter
    with their GEMMs (point-to-point sends round the tp ring, `tensor_parallel/comm_overlap.py`;
    Megatron uses Transformer Engine userbuffers)."""

    tp_comm_bulk_wgrad: bool = True
    """Hide the backward reduce-scatter of the input gradient behind the weight-gradient GEMM
    (tp_comm_overlap)."""

    tp_comm_bulk_dgrad: bool = True
    """Hide the backward all-gather of the input behind the input-gradient GEMM
    (tp_comm_overlap)."""

    tp_comm_overlap_ag: bool = True
    """Pipeline the all-gather with the GEMM (tp_comm_overlap)."""

    tp_comm_overlap_rs: bool = True
    """Pipeline the reduce-scatter with the GEMM (tp_comm_overlap)."""

    tp_comm_overlap_rs_dgrad: bool = False
    """Pipeline the input gradient's reduce-scatter with its GEMM (tp_comm_overlap)."""

    tp_comm_split_ag: bool = True
    """The all-gather overlap in chunks; False turns it off here (Transformer Engine's atomic
    GEMM alternative has no plain PyTorch counterpart)."""

    tp_comm_atomic_ag: bool = False
    """Atomic GEMM all-gather overlap (deprecated upstream)."""

    tp_comm_split_rs: bool = True
    """The reduce-scatter overlap in chunks; False turns it off here (as tp_comm_split_ag)."""

    tp_comm_atomic_rs: bool = False
    """Atomic GEMM reduce-scatter overlap (deprecated upstream)."""

    tp_comm_overlap_ub_cfgs: Optional[dict] = None
    """Per-GEMM overlap methods in Transformer Engine's userbuffers form ({'qkv_fprop':
    {'method': 'ring_exchange'}, ...}, Megatron's --tp-comm-overlap-cfg YAML): a listed GEMM turns
    its layer's pipeline on over the switches above (`tensor_parallel/comm_overlap_cfg.py`)."""

    cross_entropy_loss_fusion: bool = False
    """Use the fused vocab-parallel cross entropy; here the same math as the unfused one."""

    ###################
    # Pipeline Parallel
    ###################
    pipeline_dtype: torch.dtype = None
    """dtype of the activations sent between pipeline stages; required when
    pipeline_model_parallel_size > 1."""

    variable_seq_lengths: bool = False
    """Exchange tensor shapes before each pipeline send (sequence lengths vary per batch)."""

    overlap_p2p_comm: bool = False
    """Overlap pipeline send/recv with compute (interleaved schedule)."""

    batch_p2p_comm: bool = True
    """Issue the pipeline sends and receives of one step as one batch_isend_irecv."""

    batch_p2p_sync: bool = True
    """Synchronize after batched pipeline communication (works around older NCCL races)."""

    use_ring_exchange_p2p: bool = False
    """Use a custom ring-exchange kernel for pipeline communication; not available here."""

    deallocate_pipeline_outputs: bool = False
    """Free a stage's output tensor data once it is sent to the next stage (only its autograd
    graph is kept), saving activation memory."""

    defer_embedding_wgrad_compute: bool = False
    """Defer the output-layer weight-gradient GEMMs of the last stage to the pipeline flush."""

    wgrad_deferral_limit: int = 0
    """With defer_embedding_wgrad_compute, how many microbatches to defer (0 = all)."""

    pipeline_model_parallel_split_rank: Optional[int] = None
    """First pipeline stage of the decoder in an encoder-decoder model (T5)."""

    ###################
    # CPU Offloading
    ###################
    cpu_offloading: bool = False
    """Offload activations / weights of some layers to CPU memory."""

    cpu_offloading_num_layers: int = 0
    """How many transformer layers to offload."""

    _cpu_offloading_context: ContextManager = None
    """Internal: the offloading context of the current layer."""

    cpu_offloading_activations: bool = True
    """Offload activations (with cpu_offloading)."""

    cpu_offloading_weights: bool = True
    """Offload weights (with cpu_offloading)."""

    ###################
    # Timing
    ###################
    barrier_with_L1_time: bool = True
    """Put a barrier before the level-1 timers so they measure the slowest rank."""

    def __post_init__(self):
        """Check cross-field rules (ValueError naming the fields) and fill derived defaults."""
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hierarchical_context_parallel_sizes is not None:
            sizes = list(self.hierarchical_context_parallel_sizes)
            if len(sizes) != 2 or sizes[0] * sizes[1] != self.context_parallel_size:
                raise ValueError(
                    f"hierarchical_context_parallel_sizes ({sizes}) must be two sizes whose "
                    f"product is context_parallel_size ({self.context_parallel_size})"
                )
        if self.virtual_pipeline_model_parallel_size is not None:
            if self.virtual_pipeline_model_parallel_size < 1:
                raise ValueError(
                    "virtual_pipeline_model_parallel_size must be >= 1 or None, got "
                    f"{self.virtual_pipeline_model_parallel_size}"
                )
            if self.pipeline_model_parallel_size <= 1:
                raise ValueError(
                    "virtual_pipeline_model_parallel_size "
                    f"({self.virtual_pipeline_model_parallel_size}) needs "
                    f"pipeline_model_parallel_size > 1, got {self.pipeline_model_parallel_size}"
                )
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 cannot both be True")

        if self.sequence_parallel:
            if self.tensor_model_parallel_size <= 1:
                raise ValueError(
                    "sequence_parallel needs tensor_model_parallel_size > 1, got "
                    f"{self.tensor_model_parallel_size}"
                )
            if self.async_tensor_model_parallel_allreduce:
                # Sequence parallelism already overlaps its own reduce-scatter.
                self.async_tensor_model_parallel_allreduce = False

        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError(
                f"pipeline_model_parallel_size is {self.pipeline_model_parallel_size}: "
                "pipeline_dtype must be specified"
            )

        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype

        if self.defer_embedding_wgrad_compute and self.pipeline_model_parallel_size == 1:
            raise ValueError(
                "defer_embedding_wgrad_compute needs pipeline_model_parallel_size > 1, got 1"
            )
        if self.defer_embedding_wgrad_compute and not self.gradient_accumulation_fusion:
            raise ValueError(
                "defer_embedding_wgrad_compute needs gradient_accumulation_fusion=True"
            )
        if self.defer_embedding_wgrad_compute and self.wgrad_deferral_limit < 0:
            raise ValueError(f"wgrad_deferral_limit must be >= 0, got {self.wgrad_deferral_limit}")

        # Expert x tensor parallelism needs sequence parallelism to *train* (Megatron checks it
        # here); MoELayer refuses training without it, and inference (text generation, which
        # cannot split single-token steps along the sequence) runs without it.

        if self.cpu_offloading and not (0 <= self.cpu_offloading_num_layers):
            raise ValueError(
                f"cpu_offloading_num_layers must be >= 0, got {self.cpu_offloading_num_layers}"
            )
