"""Detokenizers for zero-shot evaluation, as in Megatron's tasks/zeroshot_gpt/detokenizer.py.

They turn the word-level tokenization of PTB and WikiText back into running text before BPE.
The detokenizer is chosen by a substring of the data path ('ptb', then 'wiki', then 'lambada').
"""

import re


def ptb_detokenizer(string: str) -> str:
    """Penn Treebank: plain substring replacements, in this order."""
    string = string.replace(" '", "'")
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" n't", "n't")
    string = string.replace(" N ", "1 ")
    string = string.replace("$ 1", "$1")
    string = string.replace("# 1", "#1")
    return string


def wikitext_detokenizer(string: str) -> str:
    """WikiText-103: contractions, number separators, punctuation, brackets, headings."""
    # contractions
    string = string.replace("s '", "s'")
    # Megatron's pattern carries literal slashes, so it only matches the text "/' d/"; kept as is
    # so the numbers match Megatron's.
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    # brackets and quotes: drop the space after the opener and before the closer
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # headings
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    # degree sign
    string = string.replace(" " + chr(176) + " ", chr(176))
    # line breaks
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    # numbers
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


def lambada_detokenizer(string: str) -> str:
    """LAMBADA: the identity."""
    return string


_DETOKENIZERS = {
    'ptb': ptb_detokenizer,
    'wiki': wikitext_detokenizer,
    'lambada': lambada_detokenizer,
}


def get_detokenizer(path: str):
    """The detokenizer whose key ('ptb', 'wiki', 'lambada', checked in that order) occurs in path.

    Raises:
        ValueError: no key occurs in the path (Megatron returns None and then crashes).
    """
    for key, detokenizer in _DETOKENIZERS.items():
        if key in path:
            return detokenizer
    raise ValueError(
        f'--valid-data {path}: the path must contain one of {list(_DETOKENIZERS)} to pick the '
        f'detokenizer (e.g. rename the file to wiki.test.tokens)'
    )
