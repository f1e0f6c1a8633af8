#!/bin/bash
# Fine-tune a pretrained BERT on MNLI, as in Megatron's examples/finetune_mnli_distributed.sh.
# TRAIN_DATA / VALID_DATA: GLUE MNLI TSV files (or the fixture of tasks/make_fixture_data.py,
# whose label is which book a passage comes from: a code-path test, not a language benchmark).
# PRETRAINED_CHECKPOINT: a BERT checkpoint with the same architecture flags as below.

WORLD_SIZE=${WORLD_SIZE:-8}
DISTRIBUTED_ARGS="--nproc_per_node $WORLD_SIZE --nnodes 1 --node_rank 0 --master_addr localhost --master_port 6000"

TRAIN_DATA=${TRAIN_DATA:-data/glue_data/MNLI/train.tsv}
VALID_DATA=${VALID_DATA:-"data/glue_data/MNLI/dev_matched.tsv data/glue_data/MNLI/dev_mismatched.tsv"}
PRETRAINED_CHECKPOINT=${PRETRAINED_CHECKPOINT:-checkpoints/bert_345m}
VOCAB_FILE=${VOCAB_FILE:-data/bert/bert-vocab.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/bert_345m_mnli}

torchrun $DISTRIBUTED_ARGS ./tasks/main.py \
               --task MNLI \
               --seed 1234 \
               --train-data $TRAIN_DATA \
               --valid-data $VALID_DATA \
               --tokenizer-type BertWordPieceLowerCase \
               --vocab-file $VOCAB_FILE \
               --epochs 5 \
               --pretrained-checkpoint $PRETRAINED_CHECKPOINT \
               --num-layers 24 \
               --hidden-size 1024 \
               --num-attention-heads 16 \
               --micro-batch-size 8 \
               --lr 5.0e-5 \
               --lr-decay-style linear \
               --lr-warmup-fraction 0.065 \
               --seq-length 512 \
               --max-position-embeddings 512 \
               --save-interval 500000 \
               --save $CHECKPOINT_PATH \
               --log-interval 10 \
               --eval-interval 100 \
               --eval-iters 50 \
               --weight-decay 1.0e-1 \
               "$@"
