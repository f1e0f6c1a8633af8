"""Merge every `.bin`/`.idx` dataset of a directory (sorted by prefix) into one dataset.

python tools/merge_datasets.py --input DIR --output-prefix OUT
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)


def get_args(argv=None):
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group(title="input data")
    group.add_argument(
        "--input",
        type=str,
        required=True,
        help="Directory whose .bin/.idx dataset pairs are merged.",
    )
    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix", type=str, required=True, help="Output path without the .bin/.idx suffix."
    )
    group = parser.add_argument_group(title="miscellaneous")
    group.add_argument(
        "--multimodal",
        action="store_true",
        help="The inputs are multimodal datasets.",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.input):
        parser.error(f"--input {args.input}: not a directory")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output_prefix))):
        parser.error(f"--output-prefix {args.output_prefix}: parent directory does not exist")
    return args


def merge(input_dir, output_prefix, multimodal=False):
    """Merge the datasets of `input_dir` into `output_prefix`; returns the prefixes merged."""
    prefixes = set()
    for basename in os.listdir(input_dir):
        prefix, ext = os.path.splitext(basename)
        if ext not in (".bin", ".idx") or prefix in prefixes:
            continue
        if not os.path.isfile(os.path.join(input_dir, basename)):
            continue
        ext_pair = ".bin" if ext == ".idx" else ".idx"
        if not os.path.isfile(os.path.join(input_dir, prefix) + ext_pair):
            raise ValueError(f"{ext_pair} file not provided for {os.path.join(input_dir, prefix)}")
        prefixes.add(prefix)
    if not prefixes:
        raise ValueError(f"no .bin/.idx datasets in {input_dir}")
    tmp_prefix = output_prefix + ".tmp-merge"
    builder = None
    try:
        for prefix in sorted(prefixes):
            if builder is None:
                dataset = IndexedDataset(os.path.join(input_dir, prefix), multimodal=multimodal)
                builder = IndexedDatasetBuilder(
                    get_bin_path(tmp_prefix), dtype=dataset.index.dtype, multimodal=multimodal
                )
                del dataset
            builder.add_index(os.path.join(input_dir, prefix))
        builder.finalize(get_idx_path(tmp_prefix))
    except BaseException:
        if builder is not None:
            builder.data_file.close()
        for path in (get_bin_path(tmp_prefix), get_idx_path(tmp_prefix)):
            if os.path.exists(path):
                os.remove(path)
        raise
    os.replace(get_bin_path(tmp_prefix), get_bin_path(output_prefix))
    os.replace(get_idx_path(tmp_prefix), get_idx_path(output_prefix))
    return sorted(prefixes)


def main(argv=None):
    args = get_args(argv)
    try:
        merged = merge(args.input, args.output_prefix, args.multimodal)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"Merged {len(merged)} datasets into {args.output_prefix}.bin/.idx", file=sys.stderr)


if __name__ == "__main__":
    main()
