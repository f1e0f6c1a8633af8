"""A converted Mixtral served and evaluated as users do, at expert and tensor parallel layouts.

A random tiny Mixtral on the GPT-2 vocabulary (4 experts, top-2) is saved with save_pretrained and
imported with tools/checkpoint/convert.py. From the checkpoint's own args (--use-checkpoint-args)
and the tokenizer files only:

- text generation (the server's model provider and request path): greedy output equals
  transformers' `generate` token for token at TP1 x EP2 and TP2 x EP2 (every expert-parallel rank
  runs the request, as the server broadcasts it);
- tasks/main.py zero-shot WIKITEXT103 gives the perplexity computed from the Hugging Face model
  (one rank), and at EP2 the same result as the EP1 checkpoint on the same two data-parallel
  ranks. (With more than one data-parallel rank the task's sampler repeats samples to even out
  the ranks, as Megatron's does, so a data-parallel result is compared with a data-parallel one.)
- the theoretical memory report counts each rank's experts (E / ep) and the model's parameters.
"""

import os

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.functional_tests.tasks_utils import result_fields, run_task
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.inference import hf_checkpoints as hc

transformers = pytest.importorskip('transformers')

PROMPTS = ['Hello world, this is', 'A']
NEW = 6
LAYOUTS = {'tp1ep1': (1, 1, 1), 'tp1ep2': (2, 1, 2), 'tp2ep2': (4, 2, 2)}  # world, tp, ep


def _hf_mixtral():
    config = transformers.MixtralConfig(
        vocab_size=hc.VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=hc.MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=hc.VOCAB_SIZE - 1,
        eos_token_id=hc.VOCAB_SIZE - 1,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if 'norm' in name else 0.2 * noise)
    return model.eval()


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp('moe_inference')
    hf = _hf_mixtral()
    hf_dir = str(root / 'hf')
    hf.save_pretrained(hf_dir)
    dirs = {}
    for name, (_, tp, ep) in LAYOUTS.items():
        dirs[name] = str(root / name)
        cu.convert(
            *('--loader', 'hf', '--saver', 'mcore', '--load-dir', hf_dir),
            *('--save-dir', dirs[name], '--target-tensor-parallel-size', str(tp)),
            *('--target-expert-parallel-size', str(ep), '--hf-tokenizer-type', 'GPT2BPETokenizer'),
            *('--seq-length', '32'),  # the zero-shot window of test_tasks_zeroshot
        )
    return hf, dirs


class _PaddedLogits:
    """The HF model seen through the converted checkpoint's padded vocabulary: the converter
    fills the padding rows of the (untied) output layer with copies of the last real row, so
    their logits repeat the last real logit (`expected_wikitext` then adds no rows of its own)."""

    def __init__(self, hf, padded_vocab):
        self.hf, self.padded_vocab = hf, padded_vocab

    def __call__(self, ids, output_hidden_states=False):
        import types

        logits = self.hf(ids).logits
        pad = logits[..., -1:].expand(*logits.shape[:-1], self.padded_vocab - logits.shape[-1])
        hidden = torch.zeros(*logits.shape[:-1], 0)
        return types.SimpleNamespace(logits=torch.cat([logits, pad], -1), hidden_states=[hidden])


def _serve(ckpt, requests):
    from tests.unit_tests.inference.test_generation import _serve_requests

    return _serve_requests(ckpt, requests)


@pytest.mark.parametrize('layout', ['tp2ep2', 'tp1ep2'])
def test_greedy_generation_matches_transformers(setup, layout):
    from tests.unit_tests.inference.test_generation import _hf_expected

    hf, dirs = setup
    world, tp, ep = LAYOUTS[layout]
    greedy = {'prompts': PROMPTS, 'tokens_to_generate': NEW, 'top_k_sampling': 1}
    outs = run_distributed(
        _serve, world_size=world, tp=tp, ep=ep, args=(dirs[layout], [greedy]), timeout=600
    )
    tokens = outs[0][0][3]
    for row, want in zip(tokens, _hf_expected(hf, PROMPTS, NEW)):
        assert row == want[: len(row)], (row, want)
        assert len(row) == len(want) or row[-1] == hc.VOCAB_SIZE - 1


def test_zero_shot_wikitext_at_both_layouts(setup, tmp_path):
    import sys

    sys.path.insert(0, cu.REPO)
    from tasks.make_fixture_data import build_all
    from tests.functional_tests.test_tasks_zeroshot import STRIDE, _args, expected_wikitext

    hf, dirs = setup
    data = build_all(
        str(tmp_path / 'data'),
        n_train=1,
        n_dev=1,
        race_train_docs=1,
        race_dev_docs=1,
        lambada=0,
        wiki_paragraphs=6,
    )
    path = os.path.join(data, 'wiki.test.tokens')

    def evaluate(layout, world, tp=1, ep=1):
        args = _args(dirs[layout], 'WIKITEXT103', path, ['--overlapping-eval', str(STRIDE)])
        outs = run_distributed(run_task, world_size=world, tp=tp, ep=ep, args=(args,), timeout=600)
        line = [x for x in outs[-1][1].splitlines() if x.startswith(' validation results on ')]
        return outs[-1][0], result_fields(line[0])

    ep2, _ = evaluate('tp1ep2', 2, ep=2)
    dp2, _ = evaluate('tp1ep1', 2)
    assert ep2['avg loss'] == pytest.approx(dp2['avg loss'], rel=1e-7)
    one, fields = evaluate('tp1ep1', 1)
    padded = cu.full_model(dirs['tp1ep1'])[1].args.padded_vocab_size
    expected = expected_wikitext(_PaddedLogits(hf, padded), path, torch.zeros(0, 0))
    assert one['avg loss'] == pytest.approx(expected['avg loss'], rel=1e-5)
    assert fields['ppl'] == pytest.approx(expected['ppl'], rel=1e-4)


def test_theoretical_memory_counts_each_ranks_experts(setup, capsys):
    from megatron.training.checkpointing import load_args_from_checkpoint
    from megatron.training.memory.theoretical_memory_moe import moe_parameter_counts
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    _, dirs = setup
    model, _ = cu.full_model(dirs['tp1ep1'])
    experts = sum(t.numel() for n, t in model.items() if '.local_experts.' in n)

    def args_of(layout):
        from megatron.training.arguments import parse_args

        args = parse_args(args_list=['--load', dirs[layout], '--use-checkpoint-args'])
        load_args_from_checkpoint(args)
        args.data_parallel_size = args.expert_model_parallel_size
        args.use_distributed_optimizer = False
        return args

    tp1, tp2ep2 = args_of('tp1ep1'), args_of('tp2ep2')
    dense, counted_experts = moe_parameter_counts(tp1)
    assert counted_experts == experts
    # Megatron's formula counts two LayerNorms with biases; RMSNorm has weights only.
    non_expert = sum(t.numel() for n, t in model.items() if '.local_experts.' not in n)
    embeddings = 2 * 32 * tp1.padded_vocab_size
    assert dense + embeddings - non_expert == 2 * 2 * 32 + 32  # the norm biases counted
    # TP2 x EP2: a quarter of the experts' bytes, half of the dense ones (18 bytes each).
    per_rank = compute_weight_and_optimizer_memory(tp2ep2, verbose=True)
    embedding_rows = 2 * 32 * tp2ep2.padded_vocab_size
    assert per_rank == pytest.approx(18 * ((dense + embedding_rows) / 2 + experts / 4))
    assert 'Number of parameters in experts in billions' in capsys.readouterr().out


def test_server_serves_moe_at_ep2(setup, tmp_path):
    """tools/run_text_generation_server.py under torchrun at TP1 x EP2 (the expert-parallel
    ranks are one replica): the greedy answer equals the in-process generation's at that layout
    (which equals transformers', above)."""
    import requests

    from tests.functional_tests.server_utils import Server

    hf, dirs = setup
    prompt = PROMPTS[:1]
    greedy = {'prompts': prompt, 'tokens_to_generate': NEW, 'top_k_sampling': 1}
    reference = run_distributed(
        _serve, world_size=2, ep=2, args=(dirs['tp1ep2'], [greedy]), timeout=600
    )[0][0][0]
    extra = ['--expert-model-parallel-size', '2']
    server = Server(dirs['tp1ep2'], 2, str(tmp_path / 'server.log'), extra=extra)
    try:
        answer = requests.put(
            server.url + '/api',
            json={'prompts': prompt, 'tokens_to_generate': NEW, 'top_k': 1},
            timeout=300,
        )
        assert answer.status_code == 200, server.read_log()
        assert answer.json()['text'] == reference, (answer.json(), reference)
    finally:
        server.stop()
