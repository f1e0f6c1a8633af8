"""Image data of the vision scripts (Megatron's `megatron/legacy/data` names): an ImageFolder
reader, its transforms and the dataset builder, in Pillow and numpy (no torchvision)."""
