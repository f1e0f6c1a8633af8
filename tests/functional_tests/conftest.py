"""Fixtures of the end-to-end tests: the bundled corpus preprocessed once per session (GPT-2 BPE
documents; BERT WordPiece sentences; BERT WordPiece fortunes for T5), and the tensor-parallel
text generation server the server test modules share (stopped after the last test using it)."""

import pytest

from tests.functional_tests.bert_utils import prepare_bert_data
from tests.functional_tests.gpt_utils import fold_to_small_vocab, prepare_data
from tests.functional_tests.t5_utils import prepare_t5_data


@pytest.fixture(scope='session')
def gpt_data_prefix(tmp_path_factory):
    """Prefix of mobydick.jsonl preprocessed with GPT-2 BPE (.bin/.idx), shared by the session."""
    return prepare_data(str(tmp_path_factory.mktemp('gpt_data')))


@pytest.fixture(scope='session')
def small_vocab_data_prefix(gpt_data_prefix, tmp_path_factory):
    """The same corpus folded into a 4096-id vocabulary (use with gpt_utils.SMALL_VOCAB_ARGS)."""
    return fold_to_small_vocab(gpt_data_prefix, str(tmp_path_factory.mktemp('gpt_data_4096')))


@pytest.fixture(scope='session')
def bert_data_prefix(tmp_path_factory):
    """Prefix of mobydick.jsonl split into sentences with the BERT vocabulary, shared by the
    session."""
    return prepare_bert_data(str(tmp_path_factory.mktemp('bert_data')))


@pytest.fixture(scope='session')
def t5_data_prefix(tmp_path_factory):
    """Prefix of 3,000 quotations of fortunes.jsonl preprocessed with the bundled BERT
    vocabulary."""
    return prepare_t5_data(str(tmp_path_factory.mktemp('t5_data')))


#: Session-scoped servers, stopped as soon as no later test of the session uses them.
_SHARED_SERVERS = {}


@pytest.fixture(scope='session')
def tp2_server(tmp_path_factory):
    """(server, HF model): one TP2 engine server (tools/run_text_generation_server.py under
    torchrun) for every server test module."""
    pytest.importorskip('transformers')
    pytest.importorskip('flask_restful')
    from tests.functional_tests.server_utils import start_tp2_engine_server

    srv, hf = start_tp2_engine_server(tmp_path_factory.mktemp('tp2_server'))
    _SHARED_SERVERS['tp2_server'] = srv
    yield srv, hf
    srv.stop()


def pytest_runtest_teardown(item, nextitem):
    """Stop a shared server once no later test needs it (session fixtures otherwise live until
    the end of the whole session)."""
    if nextitem is None or not _SHARED_SERVERS:
        return
    later = item.session.items[item.session.items.index(item) + 1 :]
    for name, srv in list(_SHARED_SERVERS.items()):
        if name in getattr(item, 'fixturenames', ()) and not any(
            name in getattr(other, 'fixturenames', ()) for other in later
        ):
            srv.stop()
            del _SHARED_SERVERS[name]
