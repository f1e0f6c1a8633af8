"""Fixtures of the end-to-end tests: the bundled corpus preprocessed once per session (GPT-2 BPE
documents; BERT WordPiece sentences; BERT WordPiece fortunes for T5)."""

import pytest

from tests.functional_tests.bert_utils import prepare_bert_data
from tests.functional_tests.gpt_utils import prepare_data
from tests.functional_tests.t5_utils import prepare_t5_data


@pytest.fixture(scope='session')
def gpt_data_prefix(tmp_path_factory):
    """Prefix of mobydick.jsonl preprocessed with GPT-2 BPE (.bin/.idx), shared by the session."""
    return prepare_data(str(tmp_path_factory.mktemp('gpt_data')))


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
