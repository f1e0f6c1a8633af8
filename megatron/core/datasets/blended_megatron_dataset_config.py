"""Configuration of the blended Megatron datasets (core_v0.8.0 fields and rules)."""

import logging
import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)


@dataclass
class BlendedMegatronDatasetConfig:
    """Configuration object for Megatron Core datasets.

    Exactly one of `blend` / `blend_per_split` may be given; with neither the datasets are mock.
    """

    random_seed: int
    """The seed for all RNG during dataset creation."""

    sequence_length: int
    """The sequence length."""

    blend: Optional[Tuple[List[str], Optional[List[float]]]] = None
    """The blend: path prefixes and optional weights, e.g. (["a", "b"], [0.3, 0.7]). Not with
    blend_per_split."""

    blend_per_split: Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]] = None
    """A blend per split (train, valid, test). Not with blend."""

    split: Optional[str] = None
    """The split string, e.g. "969,30,1". Required with blend, not with blend_per_split."""

    split_matrix: Optional[List[Tuple[float, float]]] = field(init=False, default=None)
    """The split as non-overlapping [start, end) fractions per split, derived from split."""

    num_dataset_builder_threads: int = 1
    """Threads building the mid-level datasets of a blend."""

    path_to_cache: Optional[str] = None
    """Where the index .npy files go; default `<prefix>/cache/<Class>_indices` (no cache for mock
    data)."""

    mmap_bin_files: bool = True
    """Memory-map the .bin files (else read with seeks)."""

    mock: bool = field(init=False, default=False)
    """True when neither blend nor blend_per_split is given."""

    tokenizer: Optional[MegatronTokenizer] = None
    """The tokenizer (its eod id is used; its identity keys the cache)."""

    renormalize_blend_weights: bool = False
    """Re-derive a weighted blend's weights from the per-dataset sample counts actually requested
    (--renormalize-blend-weights of later Megatron versions). False keeps core_v0.8.0 behaviour."""

    def __post_init__(self) -> None:
        if self.sequence_length is None or self.sequence_length <= 0:
            raise ValueError(
                f"sequence_length (--seq-length) must be > 0, got {self.sequence_length}"
            )
        if self.num_dataset_builder_threads < 1:
            raise ValueError(
                f"num_dataset_builder_threads must be >= 1, got {self.num_dataset_builder_threads}"
            )
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise ValueError(
                    "blend (--data-path) and blend_per_split (--train/valid/test-data-path) are "
                    "incompatible"
                )
            if self.split is not None:
                raise ValueError(
                    "split (--split) and blend_per_split (--train/valid/test-data-path) are "
                    "incompatible"
                )
            if len(self.blend_per_split) != len(Split):
                raise ValueError(
                    f"blend_per_split needs {len(Split)} entries, got {len(self.blend_per_split)}"
                )
            for split in Split:
                blend = self.blend_per_split[split.value]
                if blend is None:
                    log_single_rank(
                        logger, logging.INFO, f"blend not provided for {split.name} split"
                    )
                elif blend[1] is not None and len(blend[0]) != len(blend[1]):
                    raise ValueError(
                        f"blend_per_split[{split.name}]: {len(blend[0])} prefixes but "
                        f"{len(blend[1])} weights"
                    )
        else:
            if self.blend is not None:
                if self.blend[1] is not None and len(self.blend[0]) != len(self.blend[1]):
                    raise ValueError(
                        f"blend: {len(self.blend[0])} prefixes but {len(self.blend[1])} weights"
                    )
                if self.split is None:
                    raise ValueError(
                        "split (--split) must be provided when blend (--data-path) is given"
                    )
            else:
                # No data at all: fall back to mock data with an even three-way split.
                self.mock, self.split = True, "1,1,1"
                _announce("Let mock = True, as both blend and blend_per_split are None")
                _announce(f"Let split = {self.split}, an arbitrarily even split, as mock is True")
            self.split_matrix = convert_split_vector_to_split_matrix(
                parse_and_normalize_split(self.split)
            )
            _announce(f"Let split_matrix = {self.split_matrix}")


def _announce(message: str) -> None:
    log_single_rank(logger, logging.INFO, message)


def parse_and_normalize_split(split: str) -> List[float]:
    """ "99,1,0" -> [0.99, 0.01, 0.0] (missing entries are 0).

    Raises:
        ValueError: more than three entries, a negative entry, or all zero.
    """
    values = list(map(float, re.findall(r"[.0-9]+", split)))
    if "-" in split:
        raise ValueError(f"--split {split!r}: entries must be >= 0")
    if len(values) == 0 or len(values) > len(Split):
        raise ValueError(f"--split {split!r}: expected 1 to {len(Split)} comma-separated numbers")
    values = values + [0.0 for _ in range(len(Split) - len(values))]
    if sum(values) <= 0:
        raise ValueError(f"--split {split!r}: entries sum to 0")
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: List[float], vector_b: Optional[List[float]] = None
) -> List[Optional[Tuple[float, float]]]:
    """Split vector(s) -> book-ends per split, None for an empty split.

    With two vectors the result is their overlap (used for a preprocessing split inside a
    training split), e.g. [0.99, 0.01, 0.0] -> [(0, 0.99), (0.99, 1.0), None].
    """
    if vector_b is None:
        vector_b = vector_a

    def expansion(x):
        return [sum(x[0:i]) for i in range(len(x))] + [sum(x)]

    bookends_a = expansion(vector_a)
    bookends_b = expansion(vector_b)
    overlap = []
    for i in range(len(vector_a)):
        overlap.append(
            (max(bookends_a[i], bookends_b[i]), min(bookends_a[i + 1], bookends_b[i + 1]))
        )
    matrix = []
    for i in range(len(vector_a)):
        if overlap[i][1] <= overlap[i][0]:
            matrix.append(None)
        else:
            matrix.append(overlap[i])
    return matrix
