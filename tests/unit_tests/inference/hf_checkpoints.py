"""Tiny random Hugging Face GPT-2 and Llama models (built here, nothing downloaded) written as
Megatron checkpoints for any TP x PP layout, with the matching server command-line flags.

The HF weights are mapped with megatron/core/models/gpt/hf_weight_mapping.py, split for tensor
parallelism with its `split_state_dict_for_tensor_parallel`, cut into pipeline stages here, and
saved in Megatron's torch format (`release/mp_rank_TT[_PPP]/model_optim_rng.pt` plus the
tracker file), which `load_checkpoint` reads.
"""

import os
import pathlib

import torch

REPO = pathlib.Path(__file__).resolve().parents[3]
GPT2_VOCAB = str(REPO / "data" / "gpt2" / "gpt2-vocab.json")
GPT2_MERGES = str(REPO / "data" / "gpt2" / "gpt2-merges.txt")
#: The GPT-2 BPE vocabulary the server's tokenizer reads (its ids are the HF model's).
VOCAB_SIZE = 50257
MAX_POSITIONS = 64


def build_hf_model(arch, seed=0):
    """A random tiny GPT2LMHeadModel ("gpt2") or LlamaForCausalLM with GQA ("llama"), eval mode.

    Weights are drawn with a larger spread than HF's init so that greedy choices are decided by
    clear margins (ties between candidates would make token-for-token comparisons fragile).
    """
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if arch == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_positions=MAX_POSITIONS,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            activation_function="gelu_new",
        )
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POSITIONS,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            bos_token_id=VOCAB_SIZE - 1,
            eos_token_id=VOCAB_SIZE - 1,
        )
        model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and ("ln" in name or "norm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.2 * noise)
    return model.eval()


def server_flags(arch, tp=1, pp=1):
    """Command-line flags describing the model of `build_hf_model(arch)` (no --load)."""
    common = [
        "--num-layers",
        "2",
        "--seq-length",
        str(MAX_POSITIONS),
        "--max-position-embeddings",
        str(MAX_POSITIONS),
        "--micro-batch-size",
        "1",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        GPT2_VOCAB,
        "--merge-file",
        GPT2_MERGES,
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--distributed-backend",
        "gloo",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--transformer-impl",
        "local",
        "--seed",
        "1234",
    ]
    if arch == "gpt2":
        return common + [
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--openai-gelu",
            "--no-bias-gelu-fusion",
            "--norm-epsilon",
            "1e-5",
        ]
    return common + [
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "96",
        "--num-attention-heads",
        "8",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        "10000",
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        "1e-6",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
    ]


def padded_vocab_size(tp, divisible_by=128):
    multiple = divisible_by * tp
    return ((VOCAB_SIZE + multiple - 1) // multiple) * multiple


#: Parameters held by the last pipeline stage only.
LAST_STAGE = ("decoder.final_layernorm", "output_layer.weight")


def _stage_state_dict(full, num_layers, pp, stage, tied):
    """Keep stage `stage`'s layers (renumbered from 0) and its embedding / output layer."""
    per_stage = num_layers // pp
    first, last = stage == 0, stage == pp - 1
    out = {}
    for name, tensor in full.items():
        if name.startswith("decoder.layers."):
            index = int(name.split(".")[2])
            if stage * per_stage <= index < (stage + 1) * per_stage:
                rest = name.split(".", 3)[3]
                out[f"decoder.layers.{index - stage * per_stage}.{rest}"] = tensor
        elif (first and name.startswith("embedding.")) or (last and name.startswith(LAST_STAGE)):
            out[name] = tensor
    if last and tied and not first:
        # The last stage keeps its own copy of the tied word embeddings.
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    # Linear layers save an (empty) `_extra_state` entry, as GPTModel.state_dict() has.
    for name in list(out):
        module = name.rsplit(".", 1)[0]
        if module.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")):
            out[module + "._extra_state"] = None
    if last:
        out["output_layer._extra_state"] = None
    return out


def save_megatron_checkpoint(hf_model, arch, ckpt_dir, tp=1, pp=1):
    """Write `hf_model` as a Megatron release checkpoint of layout TP x PP into ckpt_dir."""
    from megatron.core.models.gpt import hf_weight_mapping as hfm
    from megatron.core.transformer.transformer_config import TransformerConfig

    if arch == "gpt2":
        kw = hfm.gpt2_config_kwargs(hf_model.config)
        to_mcore = hfm.gpt2_hf_to_mcore_state_dict
    else:
        kw = hfm.llama_config_kwargs(hf_model.config)
        to_mcore = hfm.llama_hf_to_mcore_state_dict
    config = TransformerConfig(**kw["config"])
    hf_sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    full = to_mcore(hf_sd, config, padded_vocab_size(tp))
    if "output_layer.weight" in full:
        rows = padded_vocab_size(tp) - full["output_layer.weight"].shape[0]
        if rows > 0:
            pad = full["output_layer.weight"].new_zeros(rows, full["output_layer.weight"].shape[1])
            full["output_layer.weight"] = torch.cat([full["output_layer.weight"], pad])
    tied = kw["model"]["share_embeddings_and_output_weights"]
    shards = hfm.split_state_dict_for_tensor_parallel(full, config, tp)
    for t, shard in enumerate(shards):
        for p in range(pp):
            sub = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            path = os.path.join(ckpt_dir, "release", sub, "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            model_sd = _stage_state_dict(shard, config.num_layers, pp, p, tied)
            torch.save({"model": model_sd, "checkpoint_version": 3.0, "iteration": 0}, path)
    with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    return ckpt_dir


def hf_greedy(hf_model, prompt_ids, new_tokens):
    """transformers' greedy continuation (with its KV cache) of one prompt: the new ids, up to
    and including the end-of-text id if it comes."""
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=VOCAB_SIZE - 1,
        eos_token_id=VOCAB_SIZE - 1,
    )
    return out[0, len(prompt_ids) :].tolist()
