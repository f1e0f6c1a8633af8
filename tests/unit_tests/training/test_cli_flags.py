"""The CLI surface is frozen: the live parser must match cli_flags.json (regenerate on purpose with
freeze_cli_flags.py), must hold every flag name of Megatron-LM core_r0.8.0 (megatron_r08_flags.txt)
and only the extra flags listed here, and every flag carries help text."""

import json
import os

from tests.unit_tests.training.freeze_cli_flags import FROZEN, live_flags

MEGATRON_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'megatron_r08_flags.txt')

# Flags of core_r0.8.0's arguments.py that the name list misses (it holds only single-quoted,
# underscore-free names): the underscore spellings and the double-quoted flags.
MEGATRON_FLAGS_NOT_IN_LIST = {
    '--test-mode',
    '--local_rank',
    '--override-opt_param-scheduler',
    '--use-checkpoint-opt_param-scheduler',
    '--retro-num-neighbors',
    '--retro-num-retrieved-chunks',
    '--retro-attention-gate',
    '--retro-no-verify-neighbor-count',
}

# Our flags that core_r0.8.0 does not have (later Megatron versions do, with these names).
OUR_EXTRA_FLAGS = {
    '--local-rank',  # hyphenated alias of --local_rank
    # Resilience flags of later Megatron (rerun state machine v0.10+, local non-persistent
    # checkpoints v0.11, CPU-offloading optimizer v0.12); --check-for-nan-in-loss-and-grad is the
    # positive spelling of r0.8's --no-check-for-nan-in-loss-and-grad.
    '--rerun-mode',
    '--error-injection-rate',
    '--error-injection-type',
    '--check-for-nan-in-loss-and-grad',
    '--check-for-spiky-loss',
    '--check-for-large-grads',
    '--result-rejected-tracker-filename',
    '--non-persistent-local-ckpt-dir',
    '--optimizer-cpu-offload',
    '--optimizer-offload-fraction',
    '--decrease-batch-size-if-needed',
    '--non-persistent-ckpt-type',
    '--non-persistent-global-ckpt-dir',
    '--non-persistent-save-interval',
    '--renormalize-blend-weights',
    '--ckpt-format',  # core_r0.9.0's checkpoint format flag (torch | torch_dist | fsdp_dtensor)
    # MoE flags of later Megatron versions (megatron/core/transformer/moe).
    '--moe-router-score-function',
    '--moe-router-topk-scaling-factor',
    '--moe-router-enable-expert-bias',
    '--moe-router-bias-update-rate',
    '--moe-router-dtype',
    '--moe-ffn-hidden-size',
    '--moe-shared-expert-intermediate-size',
    '--moe-shared-expert-gate',
    '--moe-layer-freq',
    '--cp-comm-type',  # context parallel attention communication (core_r0.10)
    # Uneven pipeline stages (core_r0.10; --standalone-embedding-stage is first = 0).
    '--decoder-first-pipeline-num-layers',
    '--decoder-last-pipeline-num-layers',
    '--hierarchical-context-parallel-sizes',  # a2a+p2p context parallelism (core_r0.10)
    '--use-pytorch-profiler',
    # Dynamic-batching inference engine (megatron/core/inference, docs/inference_engine.md).
    '--inference-dynamic-batching',
    '--inference-max-seq-length',
    '--inference-dynamic-batching-buffer-size-gb',
    '--inference-dynamic-batching-block-size',
    '--inference-dynamic-batching-max-requests',
    '--inference-dynamic-batching-max-tokens',
    '--enable-chunked-prefill',
    # Hybrid Mamba mixer sizes (core_v0.12; megatron/training/cli/arguments_mamba.py).
    '--mamba-state-dim',
    '--mamba-head-dim',
    '--mamba-num-groups',
    '--mamba-num-heads',
    '--is-hybrid-model',
    # Supervised fine-tuning and fill-in-the-middle (core_v0.13 / core_v0.16).
    '--sft',
    '--sft-tokenizer-prompt-format',
    '--fim-data',
    '--fim-rate',
    '--fim-spm-rate',
    '--fim-split-sample',
    '--fim-fragment-rate',
    '--fim-no-prefix',
    '--fim-prefix-token',
    '--fim-middle-token',
    '--fim-suffix-token',
    '--fim-pad-token',
    '--fim-eod-token',
    # multi-latent attention, YaRN and group-limited routing (arguments_mla.py)
    '--multi-latent-attention',
    '--q-lora-rank',
    '--kv-lora-rank',
    '--qk-head-dim',
    '--qk-pos-emb-head-dim',
    '--v-head-dim',
    '--rope-type',
    '--rotary-scaling-factor',
    '--mscale',
    '--mscale-all-dim',
    '--yarn-original-max-position-embeddings',
    '--yarn-beta-fast',
    '--yarn-beta-slow',
    '--yarn-correction-range-round-to-int',
    '--no-yarn-correction-range-round-to-int',
    '--use-rope-scaling',
    '--rope-scaling-factor',
    '--mtp-num-layers',
    '--mtp-loss-scaling-factor',
    '--muon-momentum',
    '--muon-nesterov',
    '--muon-use-nesterov',  # v0.16's spelling of --muon-nesterov
    '--muon-no-split-qkv',
    '--muon-scale-mode',
    '--muon-fp32-matmul-prec',
    '--muon-num-ns-steps',
    '--muon-tp-mode',
    '--muon-extra-scale-factor',
    '--qk-clip',
    '--qk-clip-alpha',
    '--qk-clip-threshold',
    '--moe-router-num-groups',
    '--moe-router-group-topk',
    # Fully sharded data parallel (core_v0.10 / core_v0.13; docs/fsdp.md).
    '--use-torch-fsdp2',
    '--torch-fsdp2-no-reshard-after-forward',
    '--use-megatron-fsdp',
    '--data-parallel-sharding-strategy',
    '--num-distributed-optimizer-instances',  # core_v0.10; here HSDP with FSDP2
}

# Flags of this package only (no Megatron version has them).
OUR_OWN_FLAGS = {
    '--torch-fsdp2-reduce-in-bf16',  # Megatron's bf16 FSDP2 numerics, opt-in (docs/fsdp.md)
    '--watchdog-timeout',  # the hang watchdog (megatron/training/run_control/watchdog.py)
    '--torch-compile',  # torch.compile of the transformer layers (megatron/training/training.py)
    '--sft-one-row-per-sample',  # Megatron's SFT packing (training/datasets/sft_dataset.py)
    '--sft-long-conversations',  # truncate or refuse data longer than a sample (same file)
    '--no-image-augmentation',  # vision scripts: validation geometry for training images
    '--vit-layout',  # the classifier in Hugging Face ViTForImageClassification's layout
    '--dino-out-dim',  # DINO head size (Megatron hard-codes 65536)
}


def _megatron_flag_names():
    with open(MEGATRON_LIST) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith('#')}


def _live_option_strings():
    return {opt for flag in live_flags().values() for opt in flag['option_strings']}


def test_cli_flags_match_frozen_list():
    with open(FROZEN) as f:
        frozen = json.load(f)
    live = json.loads(json.dumps(live_flags()))
    added = sorted(set(live) - set(frozen))
    removed = sorted(set(frozen) - set(live))
    changed = sorted(k for k in set(live) & set(frozen) if live[k] != frozen[k])
    details = [f'{k}: frozen {frozen[k]} != live {live[k]}' for k in changed]
    assert not (added or removed or changed), (
        f'CLI flags changed (run tests/unit_tests/training/freeze_cli_flags.py if deliberate): '
        f'added {added}, removed {removed}, changed:\n' + '\n'.join(details)
    )


def test_every_megatron_r08_flag_parses_and_extras_are_listed():
    megatron = _megatron_flag_names()
    assert len(megatron) == 318
    live = _live_option_strings()
    missing = sorted(megatron - live)
    assert not missing, f'Megatron core_r0.8.0 flags missing: {missing}'
    extras = live - megatron
    listed = MEGATRON_FLAGS_NOT_IN_LIST | OUR_EXTRA_FLAGS | OUR_OWN_FLAGS
    assert extras == listed, (
        f'unlisted extra flags: {sorted(extras - listed)}; '
        f'listed but absent: {sorted(listed - extras)}'
    )


def test_every_flag_has_help_and_megatron_names():
    live = live_flags()
    missing_help = [k for k, v in live.items() if not v['has_help']]
    assert not missing_help, missing_help
    # Megatron core_r0.8.0 names (dest), types and defaults.
    expected = {
        '--make-vocab-size-divisible-by': ('make_vocab_size_divisible_by', 'int', 128),
        '--split': ('split', 'str', None),
        '--initial-loss-scale': ('initial_loss_scale', 'float', 2**32),
        '--distributed-backend': ('distributed_backend', None, 'nccl'),
        '--eval-iters': ('eval_iters', 'int', 100),
        '--eval-interval': ('eval_interval', 'int', 1000),
        '--log-interval': ('log_interval', 'int', 100),
        '--lr-decay-style': ('lr_decay_style', 'str', 'linear'),
        '--override-opt_param-scheduler': ('override_opt_param_scheduler', None, False),
        '--ckpt-fully-parallel-save': ('ckpt_fully_parallel_save_deprecated', None, False),
        '--no-ckpt-fully-parallel-save': ('ckpt_fully_parallel_save', None, True),
        '--async-save': ('async_save', None, None),
        '--fp8-format': ('fp8', None, None),
        '--no-fp8-wgrad': ('fp8_wgrad', None, True),
        '--use-cpu-initialization': ('use_cpu_initialization', None, None),
        '--empty-unused-memory-level': ('empty_unused_memory_level', 'int', 0),
        '--no-data-sharding': ('data_sharding', None, True),
        '--defer-embedding-wgrad-compute': ('defer_embedding_wgrad_compute', None, False),
        '--wgrad-deferral-limit': ('wgrad_deferral_limit', 'int', 0),
        '--check-weight-hash-across-dp-replicas-interval': (
            'check_weight_hash_across_dp_replicas_interval',
            'int',
            None,
        ),
        '--dist-ckpt-strictness': ('dist_ckpt_strictness', 'str', 'assume_ok_unexpected'),
        '--disable-tp-comm-overlap-ag': ('tp_comm_overlap_ag', None, True),
        '--tp-comm-overlap-rs-dgrad': ('tp_comm_overlap_rs_dgrad', None, False),
        '--no-one-logger': ('enable_one_logger', None, True),
        '--one-logger-project': ('one_logger_project', 'str', 'megatron-lm'),
        '--app-tag-run-version': ('app_tag_run_version', 'str', '0.0.0'),
        '--straggler-ctrlr-port': ('straggler_ctrlr_port', 'int', 65535),
        '--straggler-minmax-count': ('straggler_minmax_count', 'int', 1),
        '--moe-token-drop-policy': ('moe_token_drop_policy', 'str', 'probs'),
        '--moe-expert-capacity-factor': ('moe_expert_capacity_factor', 'float', None),
        '--hybrid-attention-ratio': ('hybrid_attention_ratio', 'float', 0.0),
        '--iter-per-epoch': ('iter_per_epoch', 'int', 1250),
        '--dino-freeze-last-layer': ('dino_freeze_last_layer', 'float', 1),
        '--retriever-report-topk-accuracies': ('retriever_report_topk_accuracies', 'int', []),
        '--retro-encoder-layers': ('retro_encoder_layers', 'int', 2),
        '--retro-no-verify-neighbor-count': ('retro_verify_neighbor_count', None, True),
        '--indexer-batch-size': ('indexer_batch_size', 'int', 128),
        '--head-lr-mult': ('head_lr_mult', 'float', 1.0),
    }
    for flag, (dest, type_name, default) in expected.items():
        got = live[flag]
        assert (got['dest'], got['type'], got['default']) == (dest, type_name, default), flag
