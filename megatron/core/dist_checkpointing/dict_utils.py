"""Walking and transforming the nested dicts / lists of a (sharded) state dict."""

from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple

import torch


def nested_values(x: Any) -> Iterator[Any]:
    """Every leaf of nested dicts and lists."""
    if isinstance(x, dict):
        for v in x.values():
            yield from nested_values(v)
    elif isinstance(x, list):
        for v in x:
            yield from nested_values(v)
    else:
        yield x


def nested_items_iter(x: Any, prefix: Tuple = ()) -> Iterator[Tuple[Tuple, Any]]:
    """(path, leaf) pairs; a path is the tuple of dict keys / list indices."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from nested_items_iter(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from nested_items_iter(v, prefix + (i,))
    else:
        yield prefix, x


def dict_list_map_inplace(fn: Callable[[Any], Any], x: Any) -> Any:
    """Replace every leaf v of nested dicts / lists by fn(v), in place; returns x."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(fn, v)
    elif isinstance(x, list):
        x[:] = [dict_list_map_inplace(fn, v) for v in x]
    else:
        return fn(x)
    return x


def extract_matching_values(
    x: Any, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Any, Any]:
    """Split nested dicts / lists into (leaves matching predicate, the others).

    Containers left empty are dropped from either side (so `common.pt` holds no empty
    `model` dict, as in Megatron). Lists become dicts {index: value} with
    return_lists_as_dicts, else they keep their positions only on the matching side when all
    match.
    """

    def _split(obj):
        if isinstance(obj, dict):
            matching, other = _like(obj), _like(obj)
            for k, v in obj.items():
                m, o = _split(v)
                if m is not _EMPTY:
                    matching[k] = m
                if o is not _EMPTY:
                    other[k] = o
            return (matching or _EMPTY), (other or _EMPTY)
        if isinstance(obj, list):
            matching, other = {}, {}
            for i, v in enumerate(obj):
                m, o = _split(v)
                if m is not _EMPTY:
                    matching[i] = m
                if o is not _EMPTY:
                    other[i] = o
            if not return_lists_as_dicts:
                if len(matching) == len(obj):
                    matching = [matching[i] for i in range(len(obj))]
                if len(other) == len(obj):
                    other = [other[i] for i in range(len(obj))]
            return (matching or _EMPTY), (other or _EMPTY)
        return (obj, _EMPTY) if predicate(obj) else (_EMPTY, obj)

    matching, other = _split(x)
    if matching is _EMPTY:
        matching = {} if isinstance(x, dict) else []
    if other is _EMPTY:
        other = {} if isinstance(x, dict) else []
    return matching, other


def _like(obj: dict) -> dict:
    """An empty dict of obj's class (keeping the attributes of dict subclasses)."""
    if type(obj) is dict:
        return {}
    new = obj.__class__.__new__(obj.__class__)
    dict.__init__(new)
    new.__dict__.update(getattr(obj, '__dict__', {}))
    return new


class _Empty:
    def __bool__(self):
        return False

    def __repr__(self):
        return '<empty>'


_EMPTY = _Empty()


def merge(x1: Any, x2: Any) -> Any:
    """Merge nested x2 into x1 (dicts by key, lists / index-dicts by position); x2 wins leaves."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2)
        return x1
    if isinstance(x1, dict) and isinstance(x2, list):
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2) if i in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f'cannot merge lists of lengths {len(x1)} and {len(x2)}')
        return [merge(a, b) for a, b in zip(x1, x2)]
    return x2


def dict_list_map_outplace(fn: Callable[[Any], Any], x: Any) -> Any:
    """A copy of nested dicts / lists with every leaf v replaced by fn(v)."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(fn, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(fn, v) for v in x]
    return fn(x)


def map_reduce(
    xs: Iterable,
    key_fn: Callable[[Any], Any] = lambda x: x,
    value_fn: Callable[[Any], Any] = lambda x: x,
    reduce_fn: Callable[[List], Any] = lambda x: x,
) -> Dict:
    """Group `xs` by key_fn, map each member with value_fn, then reduce each group's list."""
    groups: Dict[Any, List] = {}
    for x in xs:
        groups.setdefault(key_fn(x), []).append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}


def _leaves_differ(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return True
        return a.shape != b.shape or not bool(torch.all(a == b))
    try:
        differ = a != b
        return bool(differ.any()) if hasattr(differ, 'any') else bool(differ)
    except Exception:  # an object without a usable comparison counts as different
        return True


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[List, List, List]:
    """Compare two nested dicts / lists.

    Returns:
        (only_left, only_right, mismatch): the paths (tuples of keys / indices) present only in
        x1, only in x2, and `(path, type(leaf1), type(leaf2))` for leaves that differ (tensors by
        shape and value, other leaves by `!=`).
    """
    only_left, only_right, mismatch = [], [], []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            left, right, mis = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += mis
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (a, b) in enumerate(zip(x1, x2)):
            left, right, mis = diff(a, b, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += mis
    elif _leaves_differ(x1, x2):
        mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch
