"""`AbstractEngine`: what every inference engine offers."""

from abc import ABC, abstractmethod
from typing import List


class AbstractEngine(ABC):
    """An inference engine turns prompts into finished requests."""

    @staticmethod
    @abstractmethod
    def generate(*args, **kwargs) -> List:
        """Generate for the given prompts; returns the finished request records (see each
        engine)."""
