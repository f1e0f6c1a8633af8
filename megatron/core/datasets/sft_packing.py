"""Chat rows for supervised fine-tuning: checking them, splitting them into conversations, and
packing tokenized conversations into fixed-length samples.

A row is `{"messages": [{"role": ..., "content": ...}, ...]}` (other keys ignored). It may hold
several conversations back to back: a new one starts at every `system` message, and messages
before the first system message form their own conversation (Megatron's rule).

A sample of length L is a *pack* of L + 1 tokens made of whole conversations:

- each conversation's positions restart at 0; with context parallelism (cp > 1) each one is
  right-padded to a multiple of 2 * cp (Megatron's rule: the zig-zag CP split cuts every
  conversation into 2 * cp equal chunks), the pads continuing its positions;
- the pack is right-padded to L + 1 tokens (the pads continue the last conversation's positions
  and belong to its segment), or cut to L + 1 tokens when longer (truncation: what follows is
  dropped);
- tokens = pack[:-1], labels = pack[1:], position_ids = positions[:-1];
- loss_mask[i] = 1 exactly when labels[i] is an assistant token of the SAME conversation as
  tokens[i] (a conversation's last token never learns the next conversation's first token);
- cu_seqlens = segment starts in token coordinates, then L, right-filled with L to length L + 1
  (so samples collate); max_seqlen = the longest segment;
- cu_seqlens_unpadded = the cumulative real-token counts of the segments (without the CP pads and
  the pad tail), right-filled with the total to length L + 1 (Megatron's `cu_seqlens` beside its
  `cu_seqlens_padded`: what attention under CP needs to leave the pads out).

`plan_packs` decides which conversations share a pack: online best fit in data order (each
conversation goes to the open pack it fills most tightly, else a new pack), deterministic.
"""

import bisect
import math
from typing import Dict, List, Sequence, Tuple

import numpy

#: The roles a message may have.
ROLES = ("system", "user", "assistant", "tool")


def split_conversations(messages: Sequence[dict]) -> List[List[dict]]:
    """Split a row's messages into conversations, one starting at every system message."""
    conversations = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def check_conversation(conversation: Sequence[dict]) -> None:
    """Raise ValueError unless the conversation can train: it has an assistant turn, every
    assistant turn follows a user or tool turn, and no assistant turn is empty."""
    previous = None
    has_assistant = False
    for i, message in enumerate(conversation):
        if message["role"] == "assistant":
            has_assistant = True
            if previous not in ("user", "tool"):
                raise ValueError(
                    f"message {i} is an assistant turn after a {previous or 'conversation start'} "
                    "turn; an assistant turn must follow a user or tool turn"
                )
            if not message["content"].strip():
                raise ValueError(f"message {i} is an empty assistant turn")
        previous = message["role"]
    if not has_assistant:
        roles = ", ".join(m["role"] for m in conversation)
        raise ValueError(f"a conversation has no assistant turn (roles: {roles}): nothing to train")


def check_row(row) -> List[List[dict]]:
    """The conversations of one parsed JSONL row, checked.

    Raises:
        ValueError: a row that is not an object, has no `messages` list, a message without a
            string role and content, an unknown role, or a conversation that cannot train (see
            `check_conversation`); the message says which message (the caller adds where).
    """
    if not isinstance(row, dict):
        raise ValueError(
            f"a row must be a JSON object with a 'messages' list, got {type(row).__name__}"
        )
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        found = sorted(row) if "messages" not in row else f"messages={messages!r:.40}"
        raise ValueError(f"no 'messages' list of {{role, content}} objects (found {found})")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} is not a {{role, content}} object with string content")
        if message.get("role") not in ROLES:
            raise ValueError(
                f"message {i} has unknown role {message.get('role')!r}; roles are "
                f"{', '.join(ROLES)}"
            )
    conversations = split_conversations(messages)
    for conversation in conversations:
        check_conversation(conversation)
    return conversations


def padded_length(length: int, context_parallel_size: int) -> int:
    """A conversation's length in a pack: a multiple of 2 * cp when cp > 1."""
    if context_parallel_size <= 1:
        return length
    multiple = 2 * context_parallel_size
    return int(math.ceil(length / multiple) * multiple)


def plan_packs(lengths: Sequence[int], capacity: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """Assign conversations (in data order) to packs of at most `capacity` tokens by online best
    fit. A conversation longer than `capacity` gets a pack of its own (and will be truncated).

    Returns:
        (pack_offsets int64 [n_packs + 1], order int64 [n]): pack k holds the conversations
        order[pack_offsets[k]:pack_offsets[k + 1]], in data order; packs are numbered by creation.
    """
    lengths = numpy.asarray(lengths, dtype=numpy.int64)
    if len(lengths) == 0:
        return numpy.zeros(1, dtype=numpy.int64), numpy.zeros(0, dtype=numpy.int64)
    smallest = int(lengths.min())
    pack_of = numpy.empty(len(lengths), dtype=numpy.int64)
    free = []  # sorted (room left, pack id) of packs that can still take the smallest item
    num_packs = 0
    for i, length in enumerate(lengths.tolist()):
        j = bisect.bisect_left(free, (length, -1))
        if j < len(free):
            room, pack = free.pop(j)
            room -= length
        else:
            pack, room = num_packs, capacity - length
            num_packs += 1
        pack_of[i] = pack
        if room >= smallest:
            bisect.insort(free, (room, pack))
    order = numpy.argsort(pack_of, kind="stable")
    counts = numpy.bincount(pack_of, minlength=num_packs)
    return numpy.concatenate(([0], numpy.cumsum(counts))).astype(numpy.int64), order


def build_packed_sample(
    conversations: Sequence[Tuple[numpy.ndarray, numpy.ndarray]],
    seq_length: int,
    pad_id: int,
    context_parallel_size: int = 1,
) -> Dict[str, numpy.ndarray]:
    """One sample from tokenized conversations (see the module docstring).

    Args:
        conversations: (token ids, trained bool mask) per conversation, in pack order.
        seq_length: L.
        pad_id: the id written into padding positions.
        context_parallel_size: cp (pads each conversation to a multiple of 2 * cp when > 1).

    Returns:
        tokens, labels, position_ids (int64 [L]), loss_mask (float32 [L]), cu_seqlens (int32
        [L + 1]), cu_seqlens_unpadded (int32 [L + 1]), max_seqlen (int32 scalar), num_truncated
        (tokens cut off, int).
    """
    length = seq_length + 1
    tokens, trained, positions, ends = [], [], [], []
    total = 0
    for ids, mask in conversations:
        n = len(ids)
        size = padded_length(n, context_parallel_size)
        tokens.append(numpy.asarray(ids, dtype=numpy.int64))
        trained.append(numpy.asarray(mask, dtype=bool))
        positions.append(numpy.arange(size, dtype=numpy.int64))
        if size > n:
            tokens.append(numpy.full(size - n, pad_id, dtype=numpy.int64))
            trained.append(numpy.zeros(size - n, dtype=bool))
        total += size
        ends.append(total)
    pack = numpy.concatenate(tokens) if tokens else numpy.zeros(0, dtype=numpy.int64)
    target = numpy.concatenate(trained) if trained else numpy.zeros(0, dtype=bool)
    position = numpy.concatenate(positions) if positions else numpy.zeros(0, dtype=numpy.int64)
    num_truncated = max(0, total - length)
    pack, target, position = pack[:length], target[:length], position[:length]
    if len(pack) < length:
        tail = length - len(pack)
        start = position[-1] + 1 if len(position) else 0
        pack = numpy.concatenate((pack, numpy.full(tail, pad_id, dtype=numpy.int64)))
        target = numpy.concatenate((target, numpy.zeros(tail, dtype=bool)))
        position = numpy.concatenate((position, numpy.arange(start, start + tail)))

    # Segment boundaries in token coordinates; the pad tail belongs to the last segment.
    boundaries = [0] + [e for e in ends[:-1] if e < seq_length] + [seq_length]
    cu_seqlens = numpy.full(length, seq_length, dtype=numpy.int32)
    cu_seqlens[: len(boundaries)] = boundaries
    # Real tokens of each segment (its conversation, without the CP pads and the pad tail).
    real = [
        min(start + len(ids), seq_length) - start
        for start, (ids, _) in zip(boundaries[:-1], conversations)
    ]
    real += [0] * (len(boundaries) - 1 - len(real))  # no conversation: one segment of pads
    cu_seqlens_unpadded = numpy.full(length, sum(real), dtype=numpy.int32)
    cu_seqlens_unpadded[: len(boundaries)] = numpy.concatenate(([0], numpy.cumsum(real)))
    segment = numpy.zeros(length, dtype=numpy.int64)
    for end in ends:
        if end < length:
            segment[end:] += 1
    loss_mask = (target[1:] & (segment[1:] == segment[:-1])).astype(numpy.float32)
    return {
        "tokens": pack[:-1].copy(),
        "labels": pack[1:].copy(),
        "loss_mask": loss_mask,
        "position_ids": position[:-1].copy(),
        "cu_seqlens": cu_seqlens,
        "cu_seqlens_unpadded": cu_seqlens_unpadded,
        "max_seqlen": numpy.int32(numpy.diff(boundaries).max()),
        "num_truncated": int(num_truncated),
    }
