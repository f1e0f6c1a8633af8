"""Answers of the text generation server that need no model: under `/v1/` an unknown path is 404
whatever the method and a known path with another method 405 (Flask's static-file rule, GET on
every path, used to swap them); a prompt the tokenizer refuses is a bad request."""

import pytest
from flask import Flask

from megatron.inference.text_generation.tokenization import UntokenizablePrompt, tokenize_batch
from megatron.inference.text_generation_server import _openai_errors_under_v1


def _app():
    app = Flask(__name__, static_url_path='')  # as MegatronServer's

    @app.route('/v1/completions', methods=['POST'])
    def completions():
        return {'ok': True}

    _openai_errors_under_v1(app)
    return app.test_client()


@pytest.mark.parametrize(
    'method,path,status',
    [
        ('GET', '/v1/nothing', 404),
        ('POST', '/v1/nothing', 404),
        ('PUT', '/v1/nothing', 404),
        ('GET', '/v1/completions', 405),
        ('PUT', '/v1/completions', 405),
        ('POST', '/v1/completions', 200),
    ],
)
def test_v1_unknown_path_is_404_and_wrong_method_405(method, path, status):
    response = _app().open(path, method=method, json={})
    assert response.status_code == status, response.get_data(as_text=True)
    if status == 405:
        assert response.headers['Allow'] == 'POST'
        assert response.get_json()['error']['message'] == f'{method} is not allowed on {path}'
    if status == 404:
        assert response.get_json()['error']['message'] == f'Invalid URL ({method} {path})'


def test_lone_surrogate_is_an_untokenizable_prompt(tmp_path):
    pytest.importorskip('transformers')
    from megatron.training.tokenizer.tokenizer import _HuggingFaceTokenizer
    from tests.unit_tests.data.sft_utils import CHATML, build_chat_tokenizer

    tokenizer = _HuggingFaceTokenizer(build_chat_tokenizer(tmp_path / 'tok', CHATML))
    with pytest.raises(UntokenizablePrompt, match=r'^prompts\[1\] cannot be tokenized by '):
        tokenize_batch(tokenizer, ['fine', 'a\ud800b'], 0, False)


@pytest.mark.parametrize(
    'world,tp,pp,ep,ok',
    [(2, 1, 1, 2, True), (4, 2, 1, 2, True), (4, 1, 2, 2, True), (2, 1, 1, 1, False)],
)
def test_server_serves_one_replica_at_any_tp_ep_pp(world, tp, pp, ep, ok):
    """The expert-parallel ranks are one replica (the engines at EP2 are checked against
    transformers in test_engine_moe.py and tests/functional_tests/test_moe_inference.py)."""
    import argparse

    from tools.run_text_generation_server import check_one_replica

    args = argparse.Namespace(
        world_size=world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        data_parallel_size=world // (tp * pp),
    )
    if ok:
        check_one_replica(args)
        return
    with pytest.raises(ValueError) as info:
        check_one_replica(args)
    assert str(info.value) == (
        'text generation runs one model replica: world size (2) must equal '
        '--tensor-model-parallel-size (1) x --pipeline-model-parallel-size (1) x '
        '--expert-model-parallel-size (1) = 1'
    )
