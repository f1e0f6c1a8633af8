"""Configuration of the Megatron optimizers (`get_megatron_optimizer`)."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class OptimizerConfig:
    """Configuration for the optimizer, mixed precision, loss scaling and gradient clipping."""

    ##############
    # General
    ##############
    optimizer: str = 'adam'
    """Optimizer: 'adam' (AdamW semantics: decoupled weight decay) or 'sgd'."""

    lr: Optional[float] = None
    """Initial learning rate; the scheduler then sets the per-group lr."""

    min_lr: Optional[float] = None
    """Minimum learning rate the scheduler decays to."""

    decoupled_lr: Optional[float] = None
    """Separate learning rate for the input and output layers (accepted; groups carry it)."""

    decoupled_min_lr: Optional[float] = None
    """Minimum learning rate for the input and output layers."""

    weight_decay: float = 0.01
    """Weight decay coefficient (L2 regularization, decoupled for Adam)."""

    ##############
    # Precision
    ##############
    fp16: bool = False
    """If true, the model is fp16: fp32 main params and a loss scaler are used."""

    bf16: bool = False
    """If true, the model is bf16: fp32 main params are used, no loss scaler."""

    params_dtype: torch.dtype = torch.float32
    """dtype of the model parameters."""

    ###############
    # Loss scaling
    ###############
    loss_scale: Optional[float] = None
    """Static loss scale (power of 2 recommended). None with fp16 means dynamic loss scaling."""

    initial_loss_scale: float = 2**32
    """Initial scale of the dynamic loss scaler."""

    min_loss_scale: float = 1.0
    """Minimum scale of the dynamic loss scaler."""

    loss_scale_window: float = 1000
    """Number of clean iterations after which the dynamic loss scale is doubled."""

    hysteresis: int = 2
    """Number of overflowing iterations tolerated before the dynamic loss scale is halved."""

    ##############
    # Optimizer
    ##############
    adam_beta1: float = 0.9
    """First coefficient for the running averages of gradient and its square in Adam."""

    adam_beta2: float = 0.999
    """Second coefficient for the running averages of gradient and its square in Adam."""

    adam_eps: float = 1e-08
    """Term added to the denominator in Adam for numerical stability."""

    sgd_momentum: float = 0.9
    """Momentum factor for SGD."""

    #######################
    # Distributed optimizer
    #######################
    use_distributed_optimizer: bool = False
    """Shard fp32 main params and optimizer state across the data-parallel group."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with backward (mirrors the DDP config)."""

    overlap_param_gather: bool = False
    """With the distributed optimizer, run the parameter all-gathers after each step in the
    background; DDP's forward pre-hooks wait for each bucket before its parameters are used."""

    optimizer_cpu_offload: bool = False
    """With the distributed optimizer, keep `optimizer_offload_fraction` of this rank's fp32 main
    params (by elements, in param-group order) and their Adam state and step on the host, and
    step them there (later Megatron's hybrid CPU-offload optimizer)."""

    optimizer_offload_fraction: float = 0.0
    """The fraction of the fp32 main-param elements `optimizer_cpu_offload` keeps on the host."""

    ################
    # Miscellaneous
    ################
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0 disables clipping)."""

    log_num_zeros_in_grad: bool = False
    """If true, count the zeros in the gradients (returned by step())."""

    barrier_with_L1_time: bool = False
    """If true, timers of level 1 call a barrier before starting."""

    timers: Optional[Callable] = None
    """Function to get timers (Megatron's Timers object), or None."""

    muon_momentum: float = 0.9
    """Muon: momentum of the orthogonalised updates."""

    muon_nesterov: bool = False
    """Muon: Nesterov momentum."""

    muon_no_split_qkv: bool = False
    """Muon: orthogonalise the fused QKV weight as one matrix (default: q, k, v apart)."""

    muon_scale_mode: str = "spectral"
    """Muon: update scale, "spectral", "shape_scaling" or "unit_rms_norm"."""

    muon_fp32_matmul_prec: str = "medium"
    """Muon: Newton-Schulz precision, "low", "medium" or "high"."""

    muon_num_ns_steps: int = 5
    """Muon: Newton-Schulz iterations."""

    muon_tp_mode: str = "duplicated"
    """Muon: TP-split weights orthogonalised whole ("duplicated") or per shard ("blockwise")."""

    muon_extra_scale_factor: float = 1.0
    """Muon: extra factor on the update."""

    def __post_init__(self):
        if self.optimizer not in ('adam', 'sgd', 'muon'):
            raise ValueError(
                f"optimizer (--optimizer) must be 'adam', 'sgd' or 'muon', got {self.optimizer!r}"
            )
        if self.optimizer == 'muon' and self.use_distributed_optimizer:
            raise ValueError(
                "--optimizer muon with --use-distributed-optimizer is not supported (the "
                "distributed optimizer shards the matrices Muon orthogonalises)"
            )
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 (--fp16, --bf16) cannot both be set")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad (--clip-grad) must be >= 0, got {self.clip_grad}")
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis (--hysteresis) must be >= 1, got {self.hysteresis}")
        if self.loss_scale_window < 1:
            raise ValueError(
                "loss_scale_window (--loss-scale-window) must be >= 1,"
                f" got {self.loss_scale_window}"
            )
        if self.min_loss_scale <= 0 or self.initial_loss_scale <= 0:
            raise ValueError(
                f"min_loss_scale ({self.min_loss_scale}) and initial_loss_scale "
                f"({self.initial_loss_scale}) (--min-loss-scale, --initial-loss-scale)"
                " must be positive"
            )
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale (--loss-scale) must be positive, got {self.loss_scale}")
