"""Tiny random Hugging Face GPT-2 and Llama models (built here, nothing downloaded), saved with
`save_pretrained` and converted to Megatron checkpoints of any TP x PP layout by the conversion
tool as users run it (`tools/checkpoint/convert.py --loader hf --saver mcore`), with the flags that
start the server on such a checkpoint.
"""

import pathlib

import torch

REPO = pathlib.Path(__file__).resolve().parents[3]
GPT2_VOCAB = str(REPO / "data" / "gpt2" / "gpt2-vocab.json")
GPT2_MERGES = str(REPO / "data" / "gpt2" / "gpt2-merges.txt")
#: The GPT-2 BPE vocabulary the server's tokenizer reads (its ids are the HF model's).
VOCAB_SIZE = 50257
MAX_POSITIONS = 64


def build_hf_model(arch, seed=0, max_positions=MAX_POSITIONS):
    """A random tiny GPT2LMHeadModel ("gpt2"), LlamaForCausalLM with GQA ("llama"),
    Qwen3ForCausalLM with GQA and per-head q/k RMSNorm, head size 16 != hidden / heads ("qwen3")
    MixtralForCausalLM with GQA, 4 experts, top-2 ("mixtral") or DeepseekV3ForCausalLM
    ("deepseek_v3": multi-latent attention with q-LoRA and YaRN, a dense then an MoE layer with
    sigmoid group-limited routing, expert bias and a shared expert), eval mode.

    Weights are drawn with a larger spread than HF's init so that greedy choices are decided by
    clear margins (ties between candidates would make token-for-token comparisons fragile).
    """
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    if arch == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_positions=max_positions,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            activation_function="gelu_new",
        )
        model = GPT2LMHeadModel(config)
    elif arch == "mixtral":
        config = MixtralConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            bos_token_id=VOCAB_SIZE - 1,
            eos_token_id=VOCAB_SIZE - 1,
        )
        model = MixtralForCausalLM(config)
    elif arch == "deepseek_v3":
        model = _deepseek_v3(max_positions)
    elif arch == "qwen3":
        config = Qwen3Config(
            vocab_size=VOCAB_SIZE,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=max_positions,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            bos_token_id=VOCAB_SIZE - 1,
            eos_token_id=VOCAB_SIZE - 1,
        )
        model = Qwen3ForCausalLM(config)
    else:
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
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
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the expert bias (a buffer in HF)
                buffer.copy_(0.2 * torch.rand(buffer.shape, generator=g))
    return model.eval()


def _deepseek_v3(max_positions):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        max_position_embeddings=max_positions,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        rope_interleave=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=VOCAB_SIZE - 1,
        eos_token_id=VOCAB_SIZE - 1,
    )
    config._attn_implementation = "eager"
    return DeepseekV3ForCausalLM(config)


def server_flags(ckpt):
    """Flags that start the text generation server (or `initialize_megatron` with the server's
    extra args) on a converted checkpoint: the model comes from the checkpoint's own args
    (--use-checkpoint-args, tensor / pipeline sizes included); only the tokenizer files are given
    (gloo is picked when there is no GPU)."""
    return [
        "--load",
        ckpt,
        "--use-checkpoint-args",
        "--vocab-file",
        GPT2_VOCAB,
        "--merge-file",
        GPT2_MERGES,
    ]


def padded_vocab_size(tp, divisible_by=128):
    multiple = divisible_by * tp
    return ((VOCAB_SIZE + multiple - 1) // multiple) * multiple


# Conversions done in this test session, by (arch, tp, pp): each is a convert.py subprocess, so
# every test module asking for the same layout shares one.
_HF_MODELS = {}
_HF_DIRS = {}
_CONVERTED = {}


def hf_model(arch):
    """`build_hf_model(arch)`, built once per session: the model every checkpoint is made of."""
    if arch not in _HF_MODELS:
        _HF_MODELS[arch] = build_hf_model(arch)
    return _HF_MODELS[arch]


def hf_model_dir(arch, tmp_path_factory):
    """`hf_model(arch)` written with save_pretrained (config.json + model.safetensors)."""
    if arch not in _HF_DIRS:
        path = tmp_path_factory.mktemp(f"hf_{arch}")
        hf_model(arch).save_pretrained(str(path), safe_serialization=True)
        _HF_DIRS[arch] = str(path)
    return _HF_DIRS[arch]


def converted_checkpoint(arch, tp, pp, tmp_path_factory, ep=1):
    """The HF directory of `arch` converted by tools/checkpoint/convert.py (loader hf, saver
    mcore) to a TP x PP (x EP, MoE only) checkpoint; converted once per session and layout."""
    from tests.functional_tests import convert_utils as cu

    key = (arch, tp, pp, ep)
    if key not in _CONVERTED:
        save_dir = str(tmp_path_factory.mktemp(f"ckpt_{arch}_tp{tp}_pp{pp}_ep{ep}"))
        cu.convert(
            "--loader",
            "hf",
            "--saver",
            "mcore",
            "--load-dir",
            hf_model_dir(arch, tmp_path_factory),
            "--save-dir",
            save_dir,
            "--target-tensor-parallel-size",
            str(tp),
            "--target-pipeline-parallel-size",
            str(pp),
            *(("--target-expert-parallel-size", str(ep)) if ep > 1 else ()),
            # The tiny Llama uses GPT-2's vocabulary (the loader's default for a Llama is the
            # Hugging Face tokenizer of the directory).
            "--hf-tokenizer-type",
            "GPT2BPETokenizer",
        )
        _CONVERTED[key] = save_dir
    return _CONVERTED[key]


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
