"""What a run reports: the per-iteration training log line and its family-specific parts
(`training_log*`), progress logs, TensorBoard / W&B scalar writers, the profiler window and
other observability hooks.
"""
