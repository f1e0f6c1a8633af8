"""megatron.core.datasets: indexed datasets, GPT sample construction, blending and the C++ helpers.

Submodules are imported where needed (`from megatron.core.datasets.gpt_dataset import GPTDataset`),
so importing the package stays cheap.
"""
