"""Small helpers of the inference package."""


class Counter:
    """A monotonically increasing counter: `next()` returns the current value, then increments.

    Request ids come from it (as strings: "0", "1", ...).
    """

    def __init__(self, start: int = 0):
        self.counter = start

    def __next__(self) -> int:
        value = self.counter
        self.counter += 1
        return value

    def reset(self) -> None:
        """Start again from 0."""
        self.counter = 0
