"""Hybrid Mamba models through the inference engines (megatron.core.inference):

- greedy tokens of the static engine (dense KV cache + conv / SSM states in InferenceParams) and
  of the dynamic engine (paged KV cache + one conv / SSM state per request slot; requests arriving
  at different steps, prompt chunks, preemption and recompute) equal greedy decoding by full
  recomputation without any cache, token for token, on a tiny random hybrid (pattern M*-M, RoPE);
- the same at TP2 (heads and groups split, states per rank) and at PP2 (stages M* and -M,
  hidden states sent between them), against the unsplit model;
- a pure-Mamba model mapped from a random HF Mamba2ForCausalLM gives HF generate's greedy
  tokens through the dynamic engine.

Float64 models with sharpened weights (clear greedy margins): the scan itself runs in fp32, so
cached and recomputed logits differ at fp32 rounding only.
"""

import zlib

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

VOCAB = 128  # the null tokenizer's 127 ids + its EOD (127)
EOD = VOCAB - 1
MAX_SEQ = 48
NEW = 10


def _named_weights(model, layer_offset):
    """Weights drawn from each parameter's global name only (the same at any pipeline split)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split('.')
            if 'layers' in parts:
                i = parts.index('layers') + 1
                parts[i] = str(int(parts[i]) + layer_offset)
            g = torch.Generator().manual_seed(zlib.crc32('.'.join(parts).encode()))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith('A_log'):
                p.copy_(torch.log(torch.rand(p.shape, generator=g, dtype=torch.float64) * 7 + 1))
            elif name.endswith('dt_bias'):
                p.copy_(noise - 2.0)
            elif name.endswith('weight') and 'norm' in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith('.D'):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 if p.dim() > 1 else 0.1))


def _hybrid(seed=0, pp_stage=None):
    """(model, config, controller) of a tiny random float64 hybrid M*-M for this TP; with
    pp_stage (pre_process, post_process, layer offset) this pipeline stage of it, with weights
    from the parameter names."""
    from megatron.core import parallel_state
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=8, normalization='RMSNorm',
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float64, tensor_model_parallel_size=tp,
    )  # fmt: skip
    pre, post, offset = pp_stage or (True, True, None)
    model = MambaModel(
        config, mamba_stack_spec, vocab_size=VOCAB, max_sequence_length=MAX_SEQ,
        hybrid_override_pattern='M*-M', position_embedding_type='rope', parallel_output=False,
        pre_process=pre, post_process=post,
    )  # fmt: skip
    model = model.to(torch.float64)
    if offset is not None:
        _named_weights(model, offset)
    return _wrap(model, config, sharpen=offset is None)


def _wrap(model, config, sharpen):
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    if sharpen:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() > 1 and 'conv1d' not in name:
                    p.mul_(3.0)
    model.eval()
    dtype = next(model.parameters()).dtype
    wrapper = GPTInferenceWrapper(
        model, InferenceWrapperConfig(config.hidden_size, dtype, 512, VOCAB)
    )
    return model, config, TextGenerationController(wrapper, _NullTokenizer(VOCAB - 1))


def _no_cache_greedy(model, prompt, n):
    """Greedy tokens by a full forward over everything so far at every step (no cache)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens]), None, None)
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOD, (n,), generator=g).tolist() for n in lengths]


def _greedy(n):
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(top_k=1, num_tokens_to_generate=n, termination_id=-1)


def _dynamic(controller, config, num_blocks=64, max_tokens=64, chunked=False):
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    context = DynamicInferenceContext(
        config, max_sequence_length=MAX_SEQ, block_size_tokens=4, num_blocks=num_blocks,
        max_tokens=max_tokens, max_requests=4,
    )  # fmt: skip
    return DynamicInferenceEngine(controller, context, enable_chunked_prefill=chunked)


def _run(engine, prompts, arrival_steps):
    """Add prompt i at step arrival_steps[i]; step until all finish; their tokens and the
    preemptions."""
    ids = [None] * len(prompts)
    step = 0
    while any(i is None for i in ids) or engine.has_unfinished_requests():
        for i, prompt in enumerate(prompts):
            if ids[i] is None and arrival_steps[i] <= step:
                ids[i] = engine.add_request(prompt, _greedy(NEW))
        engine.step()
        step += 1
        assert step < 1000, 'engine made no progress'
    requests = [engine.get_request(i) for i in ids]
    return [list(r.generated_tokens) for r in requests], sum(r.num_preemptions for r in requests)


def _engines_rank():
    model, config, controller = _hybrid()
    # Prompts shorter and longer than the conv width (4) and the scan chunks.
    prompts = _prompts([1, 3, 7, 12, 20])
    reference = [_no_cache_greedy(model, p, NEW) for p in prompts]
    static_out = _static_tokens(controller, prompts)
    dynamic_out, _ = _run(_dynamic(controller, config), prompts, [0, 0, 1, 3, 4])
    # Prompt chunks of at most 5 tokens per step, and blocks for ~2 requests only: requests are
    # preempted, recomputed from position 0 (state slots reset) and still get their tokens.
    tight, preempted = _run(
        _dynamic(controller, config, num_blocks=12, max_tokens=5, chunked=True),
        prompts,
        [0, 0, 1, 1, 2],
    )
    return dict(
        reference=reference, static=static_out, dynamic=dynamic_out, tight=tight,
        preempted=preempted,
    )  # fmt: skip


def _static_tokens(controller, prompts):
    """The static engine's batch (prompts of different lengths in one padded batch)."""
    from megatron.core.inference.inference_request import InferenceRequest

    requests = {
        str(i): InferenceRequest(
            request_id=str(i),
            prompt='',
            inference_parameters=_greedy(NEW),
            prompt_tokens=p,
            arrival_time=0.0,
            status=None,
        )  # fmt: skip
        for i, p in enumerate(prompts)
    }
    done = controller.generate_all_output_tokens_static_batch(requests)
    return [done[str(i)].generated_tokens.tolist() for i in range(len(prompts))]


@pytest.mark.parametrize('tp', [1, 2])
def test_engines_greedy_equals_no_cache_recompute(tp):
    out = run_distributed(_engines_rank, world_size=tp, tp=tp)[0]
    assert out['static'] == out['reference']
    assert out['dynamic'] == out['reference']
    assert out['tight'] == out['reference']
    assert out['preempted'] > 0
    # A model that is not constant: the requests generate different tokens.
    assert len({tuple(t) for t in out['reference']}) > 1


def _pp_rank():
    """The engines on a PP2 split (stage 0: M*, stage 1: -M) against the unsplit model's
    no-cache greedy tokens (computed on rank 0 of the same group with the same named weights)."""
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    prompts = _prompts([1, 6, 11])
    if pp == 1:
        model, _, _ = _hybrid(pp_stage=(True, True, 0))
        return [_no_cache_greedy(model, p, NEW) for p in prompts]
    _, config, controller = _hybrid(pp_stage=(rank == 0, rank == pp - 1, rank * 4 // pp))
    static = _static_tokens(controller, prompts)
    dynamic, _ = _run(_dynamic(controller, config, max_tokens=8, chunked=True), prompts, [0, 1, 1])
    return dict(static=static, dynamic=dynamic)


def test_engines_pp2_equal_unsplit_no_cache_greedy():
    (reference,) = run_distributed(_pp_rank, world_size=1)
    assert len({tuple(t) for t in reference}) > 1
    for out in run_distributed(_pp_rank, world_size=2, pp=2):
        assert out['static'] == reference
        assert out['dynamic'] == reference


def _hf_mamba2_rank():
    transformers = pytest.importorskip('transformers')
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba import hf_weight_mapping as hfm
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2,
        expand=2, num_hidden_layers=2, conv_kernel=4, chunk_size=8, use_bias=False,
        use_conv_bias=True, layer_norm_epsilon=1e-5, residual_in_fp32=False,
        tie_word_embeddings=True,
    )  # fmt: skip
    hf = transformers.Mamba2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith('A_log'):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7 + 1))
            elif name.endswith('dt_bias'):
                p.copy_(torch.randn(p.shape, generator=g) - 2.0)
            elif not name.endswith('norm.weight') and not name.endswith('norm_f.weight'):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hf.eval()
    kw = hfm.mamba_config_kwargs(cfg)
    config = TransformerConfig(**kw['config'], use_cpu_initialization=True)
    model = MambaModel(
        config=config, mamba_stack_spec=mamba_stack_spec, **kw['model'], parallel_output=False
    )
    pattern = kw['model']['hybrid_override_pattern']
    tied = kw['model']['share_embeddings_and_output_weights']
    sd = hfm.hf_to_mcore_state_dict(dict(hf.state_dict()), config, pattern, tied=tied)
    model.load_state_dict(sd, strict=False)
    model, config, controller = _wrap(model, config, sharpen=False)
    prompts = _prompts([2, 6, 9], seed=5)
    hf.generation_config.eos_token_id = None
    hf_out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
            hf_out.append(out[0, len(p) :].tolist())
    ours, _ = _run(_dynamic(controller, config), prompts, [0, 1, 1])
    return hf_out, ours


def test_dynamic_engine_matches_hf_mamba2_generate():
    pytest.importorskip('transformers')
    ((hf_out, ours),) = run_distributed(_hf_mamba2_rank, world_size=1)
    assert ours == hf_out


def _swap_rank():
    from megatron.core.inference_params import InferenceParams

    model, _, _ = _hybrid()
    params = InferenceParams(max_batch_size=3, max_sequence_length=8)
    with torch.no_grad():
        model(torch.tensor(_prompts([5, 5, 5])), None, None, inference_params=params)
    before = {k: [t.clone() for t in v] for k, v in params.key_value_memory_dict.items()}
    params.swap_key_value_dict(torch.tensor([2, 0, 0]))
    return before, {k: list(v) for k, v in params.key_value_memory_dict.items()}


def test_beam_swap_reorders_recurrent_states_batch_first():
    """Beam search's row reordering: Mamba states are batch first, KV caches batch second."""
    ((before, after),) = run_distributed(_swap_rank, world_size=1)
    assert sorted(after) == [1, 2, 4]  # Mamba layers 1 and 4, attention layer 2
    for layer in (1, 4):
        for old, new in zip(before[layer], after[layer]):
            assert torch.equal(new, old[[2, 0, 0]])
    for old, new in zip(before[2], after[2]):
        assert torch.equal(new, old[:, [2, 0, 0]])


def test_kv_blocks_are_sized_by_the_attention_layers_only():
    """The server's paged KV cache of a hybrid counts the attention layers of the fullest stage
    (a Mamba layer holds no KV block), the same on every rank."""
    from types import SimpleNamespace

    from megatron.inference.inference_engine import _kv_layers_per_stage

    def args(pattern, pp):
        return SimpleNamespace(
            is_hybrid_model=True, spec=None, num_layers=len(pattern), hybrid_attention_ratio=0.0,
            hybrid_mlp_ratio=0.0, hybrid_override_pattern=pattern, pipeline_model_parallel_size=pp,
        )  # fmt: skip

    assert _kv_layers_per_stage(args('M*-M**', 2)) == 2  # stages M*- and M**
    assert _kv_layers_per_stage(args('M*-M**', 1)) == 3
    assert _kv_layers_per_stage(args('MM', 1)) == 0
    assert _kv_layers_per_stage(SimpleNamespace(is_hybrid_model=False, spec=None)) is None
