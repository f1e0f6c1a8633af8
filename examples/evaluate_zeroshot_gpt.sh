#!/bin/bash
# Zero-shot evaluation of a GPT checkpoint on WikiText-103 (perplexity) or LAMBADA (cloze
# accuracy), as in Megatron's examples/evaluate_zeroshot_gpt.sh.
#   TASK=WIKITEXT103 VALID_DATA=<wiki.test.tokens> CHECKPOINT=<dir> bash examples/evaluate_zeroshot_gpt.sh
#   TASK=LAMBADA VALID_DATA=<lambada_test.jsonl> CHECKPOINT=<dir> bash examples/evaluate_zeroshot_gpt.sh
# The WikiText path must contain "wiki" (it picks the detokenizer). For a quick try on this repo's
# fixtures: python tasks/make_fixture_data.py --output-dir /tmp/task_data (they test the code
# paths, not language ability). The model flags come from the checkpoint (--use-checkpoint-args).

WORLD_SIZE=${WORLD_SIZE:-1}
DISTRIBUTED_ARGS="--nproc_per_node $WORLD_SIZE --nnodes 1 --node_rank 0 --master_addr localhost --master_port 6000"

TASK=${TASK:-LAMBADA}
VALID_DATA=${VALID_DATA:-/tmp/task_data/lambada_test.jsonl}
VOCAB_FILE=${VOCAB_FILE:-data/gpt2/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-data/gpt2/gpt2-merges.txt}
CHECKPOINT=${CHECKPOINT:-checkpoints/gpt2_345m}

torchrun $DISTRIBUTED_ARGS ./tasks/main.py \
       --task $TASK \
       --valid-data $VALID_DATA \
       --tokenizer-type GPT2BPETokenizer \
       --strict-lambada \
       --vocab-file $VOCAB_FILE \
       --merge-file $MERGE_FILE \
       --load $CHECKPOINT \
       --use-checkpoint-args \
       --micro-batch-size 8 \
       --log-interval 10 \
       --no-load-optim \
       --no-load-rng \
       "$@"
