"""tools/checkpoint/convert.py --model-type mamba: a tiny random NemotronH (hybrid) and Mamba2
model saved with save_pretrained, imported at TP2 x PP2 / TP2, exported back; the exported
tensors equal the originals bitwise, and the TP2 checkpoint (its shards merged per segment)
gives Hugging Face's logits. Nothing is downloaded."""

import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

_TOOLS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    'tools',
    'checkpoint',
)
VOCAB = 61  # not a multiple of the padding: import pads, export trims


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == 'mamba2':
        cfg = transformers.Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2,
            expand=2, num_hidden_layers=2, conv_kernel=4, chunk_size=8, use_bias=False,
            use_conv_bias=True, residual_in_fp32=False, tie_word_embeddings=True,
        )  # fmt: skip
        return transformers.Mamba2ForCausalLM(cfg)
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=['mamba', 'attention', 'mlp', 'mamba'],
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4,
        chunk_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, mlp_hidden_act='relu2', use_bias=False, use_conv_bias=True,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        attn_implementation='eager',
    )  # fmt: skip
    hf = transformers.NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith('dt_bias') or name.endswith('norm.weight'):
                p.add_(torch.randn_like(p) * 0.1)  # off their constant initial values
    return hf


def _convert(*argv):
    if _TOOLS not in sys.path:
        sys.path.insert(0, _TOOLS)
    import convert

    return convert.main(list(argv))


def _hf_tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, 'model.safetensors'))


@pytest.mark.parametrize('kind,tp,pp', [('nemotron_h', 2, 2), ('mamba2', 2, 1)])
def test_hf_to_tp2_to_hf_round_trip(kind, tp, pp, tmp_path):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / 'hf')
    common = ['--model-type', 'mamba', '--hf-tokenizer-type', 'GPT2BPETokenizer']
    # 4 Mamba heads, 2 groups: TP3 is refused in one line before any process starts.
    rc = _convert(
        *common, '--loader', 'hf', '--saver', 'mcore', '--load-dir', str(tmp_path / 'hf'),
        '--save-dir', str(tmp_path / 'bad'), '--target-tensor-parallel-size', '3',
    )  # fmt: skip
    assert rc == 2 and not (tmp_path / 'bad').exists()
    rc = _convert(
        *common, '--loader', 'hf', '--saver', 'mcore', '--load-dir', str(tmp_path / 'hf'),
        '--save-dir', str(tmp_path / 'mcore'), '--target-tensor-parallel-size', str(tp),
        '--target-pipeline-parallel-size', str(pp),
    )  # fmt: skip
    assert rc == 0
    rc = _convert(
        '--model-type', 'mamba', '--loader', 'mcore', '--saver', 'hf',
        '--load-dir', str(tmp_path / 'mcore'), '--save-dir', str(tmp_path / 'back'),
    )  # fmt: skip
    assert rc == 0
    original, back = _hf_tensors(tmp_path / 'hf'), _hf_tensors(tmp_path / 'back')
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    reloaded = type(hf).from_pretrained(tmp_path / 'back')
    assert (
        reloaded.config.to_dict()['layers_block_type' if kind != 'mamba2' else 'num_heads']
        == (hf.config.to_dict()['layers_block_type' if kind != 'mamba2' else 'num_heads'])
    )


def _logits_rank(ckpt_dir, hf_config_dict, tokens):
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba import hf_weight_mapping as hfm
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.checkpoint import checkpoint_conversion_mamba as ccm

    full, _ = ccm.full_state_dict(ccm.MambaCheckpointReader(ckpt_dir))
    kw = hfm.mamba_config_kwargs(transformers.NemotronHConfig(**hf_config_dict))
    config = TransformerConfig(**kw['config'], use_cpu_initialization=True)
    model = MambaModel(
        config=config,
        mamba_stack_spec=mamba_stack_spec,
        **dict(kw['model'], vocab_size=full['embedding.word_embeddings.weight'].shape[0]),
    )
    missing, unexpected = model.load_state_dict(full, strict=False)
    assert not unexpected and all(k.endswith('._extra_state') for k in missing), missing
    model.eval()
    with torch.no_grad():
        return model(tokens, None, None)[..., :VOCAB]


def test_tp2_checkpoint_gives_hf_logits(tmp_path):
    from megatron.training.checkpoint.checkpoint_conversion import torch_load_weights_only
    from tests.unit_tests.dist_utils import run_distributed

    hf = _hf_model('nemotron_h')
    hf.save_pretrained(tmp_path / 'hf')
    rc = _convert(
        '--model-type', 'mamba', '--hf-tokenizer-type', 'GPT2BPETokenizer', '--loader', 'hf',
        '--saver', 'mcore', '--load-dir', str(tmp_path / 'hf'), '--save-dir', str(tmp_path / 'm'),
        '--target-tensor-parallel-size', '2',
    )  # fmt: skip
    assert rc == 0
    # Rank 1's in_proj holds the second half of each of z | x | B | C | dt.
    rank1 = torch_load_weights_only(
        str(tmp_path / 'm' / 'iter_0000001' / 'mp_rank_01' / 'model_optim_rng.pt')
    )['model']['decoder.layers.0.mixer.in_proj.weight']
    full = hf.state_dict()['model.layers.0.mixer.in_proj.weight']
    segments = torch.split(full, [64, 64, 16, 16, 4])
    assert torch.equal(rank1, torch.cat([s[s.shape[0] // 2 :] for s in segments]))

    for module in hf.modules():  # Megatron never clamps dt; NemotronH's prefill does
        if hasattr(module, 'time_step_limit'):
            module.time_step_limit = (0.0, float('inf'))
    hf.eval()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens).logits
    (ours,) = run_distributed(
        _logits_rank, world_size=1, args=(str(tmp_path / 'm'), hf.config.to_dict(), tokens)
    )
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
