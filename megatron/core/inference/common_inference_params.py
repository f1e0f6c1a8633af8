"""`CommonInferenceParams`: core_r0.8.0's name of the sampling settings shared by a batch (later
megatron-core renamed them `SamplingParams`; both names are the same class here, and every request
may carry its own)."""

from megatron.core.inference.sampling_params import SamplingParams

CommonInferenceParams = SamplingParams

__all__ = ["CommonInferenceParams"]
