"""`KVBlockAllocator`: hands out the ids of the KV cache's fixed-size blocks."""

from typing import List, Optional


class KVBlockAllocator:
    """A stack of free block ids (the most recently freed block is reused first).

    Args:
        total_count (int): number of blocks in the pool.
    """

    def __init__(self, total_count: int):
        if total_count < 1:
            raise ValueError(f"the KV cache needs at least one block, got {total_count}")
        self.total_count = total_count
        self.block_bag: List[int] = list(range(total_count - 1, -1, -1))

    @property
    def total_avail(self) -> int:
        """Free blocks."""
        return len(self.block_bag)

    def is_memory_available(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.block_bag)

    def allocate_memory_blocks(self, num_blocks: int) -> Optional[List[int]]:
        """`num_blocks` free ids, or None (nothing taken) when fewer are free."""
        if num_blocks > len(self.block_bag):
            return None
        if num_blocks == 0:
            return []
        taken = self.block_bag[-num_blocks:]
        del self.block_bag[-num_blocks:]
        return taken[::-1]

    def release_memory_blocks(self, blocks: List[int]) -> None:
        """Give blocks back."""
        assert len(self.block_bag) + len(blocks) <= self.total_count, "released a block twice"
        self.block_bag.extend(reversed(blocks))
