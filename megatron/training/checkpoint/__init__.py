"""Everything a checkpoint is made of besides the public `megatron.training.checkpointing`
save/load entry points: the tracker file and directory layout, the RNG states, the args recorded
in a checkpoint, the torch_dist (distributed) format and the distributed optimizer's shards,
conversion between layouts and parallel sizes, and Hugging Face import/export.
"""
