"""megatron-core inference: requests, scheduling, model wrappers, text generation controllers and
engines (core_r0.8.0's `megatron.core.inference` API), plus a dynamic-batching engine over a paged
KV cache (`engines/dynamic_engine.py`, `contexts/dynamic_context.py`).

Layout (one concept per module):
- `sampling_params.py` / `common_inference_params.py`: per-request sampling settings.
- `inference_request.py`: `Status` and the request records.
- `scheduler.py`: r0.8's static scheduler (active / waiting / completed pools).
- `model_inference_wrappers/`: run one forward of a model (TP gather, PP send / receive).
- `text_generation_controllers/`: tokenization, sampling, the static generation loop and the
  dynamic step.
- `contexts/`: the paged KV cache (blocks), its allocator and the paged attention.
- `engines/`: `MCoreEngine` (static batching) and `DynamicInferenceEngine` (continuous batching).

See docs/inference_engine.md.
"""
