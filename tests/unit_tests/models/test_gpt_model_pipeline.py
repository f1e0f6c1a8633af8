"""GPTModel split over pipeline stages (with TP) against the single-stage model.

- PP=2 x TP=2: stage 0 holds the embedding and layer 0, stage 1 layer 1, the final norm and the
  output layer; the last stage's tied output weight starts as a copy of stage 0's embedding
  (zero-fill + all-reduce over the embedding group). Activations and gradients are exchanged by
  hand with send/recv; loss and every gradient (tied embedding gradients summed over the
  embedding group) equal the PP=1 model's.
- Virtual pipeline (PP=2, VP=2, 8 layers): global layer numbers per model chunk, embedding only
  on the first chunk, output layer only on the last, tied weights synchronised across chunks.
"""

import torch

from tests.unit_tests.dist_utils import run_distributed

WORLD = 4
ATOL = 2e-5


def _reference():
    from tests.unit_tests.models.test_gpt_model_parallel import _run

    return _run("gpt2", {})


def _pipeline_run(full_params):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.hf_weight_mapping import split_state_dict_for_tensor_parallel
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from tests.unit_tests.models import gpt_test_utils as U

    model, config = U.build_gpt(U.gpt2_like_kwargs(), arch="gpt2")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    offset = get_transformer_layer_offset(config)
    out = {
        "layer_numbers": [layer.layer_number for layer in model.decoder.layers],
        "has_embedding": hasattr(model, "embedding"),
        "has_output_layer": hasattr(model, "output_layer"),
        "first": first,
    }
    full_shard = split_state_dict_for_tensor_parallel(full_params, config, tp)[tp_rank]
    if last:
        # Tied weights synchronised at construction: the zero-filled copy now holds stage 0's table.
        out["output_weight_synced"] = torch.equal(
            model.output_layer.weight.detach(), full_shard["embedding.word_embeddings.weight"]
        )
        assert getattr(model.output_layer.weight, "shared_embedding", False)
    else:
        assert getattr(model.embedding.word_embeddings.weight, "shared_embedding", False)

    # Local names -> global names (layer index + stage offset).
    def global_name(name):
        parts = name.split(".")
        if name.startswith("decoder.layers."):
            parts[2] = str(int(parts[2]) + offset)
        return ".".join(parts)

    local_sd = {}
    for name, value in model.state_dict().items():
        gname = global_name(name)
        if name == "output_layer.weight" and not first:
            gname = "embedding.word_embeddings.weight"
        if isinstance(value, torch.Tensor):
            local_sd[name] = full_shard[gname]
    model.load_state_dict(local_sd, strict=False)
    model.train()

    tokens, labels = U.batch()
    position_ids = torch.arange(U.SEQ).unsqueeze(0).expand(U.BATCH, -1)
    shape = (U.SEQ, U.BATCH, config.hidden_size)
    if first:
        hidden = model(tokens, position_ids, None)
        torch.distributed.send(
            hidden.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank()
        )
        grad = torch.empty(shape)
        torch.distributed.recv(grad, ps.get_pipeline_model_parallel_next_rank())
        hidden.backward(grad)
    else:
        received = torch.empty(shape)
        torch.distributed.recv(received, ps.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(True)
        model.set_input_tensor(received)
        loss = model(None, None, None, labels=labels)
        loss.mean().backward()
        torch.distributed.send(
            received.grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank()
        )
        out["loss"] = loss.detach()

    # The tied-embedding gradient reduction of finalize_model_grads.
    if ps.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight()
        torch.distributed.all_reduce(weight.grad, group=ps.get_embedding_group())

    grads = {}
    for name, grad in U.gather_full(U.grads_of(model), config).items():
        gname = global_name(name)
        if name == "output_layer.weight":
            gname = "embedding.word_embeddings.weight"
        grads[gname] = grad
    out["grads"] = grads
    return out


def test_pipeline_two_stages_with_tp_matches_single_stage():
    ref = run_distributed(_reference, WORLD, tp=1)[0]
    outs = run_distributed(_pipeline_run, WORLD, tp=2, pp=2, args=(ref["params"],))
    # Rank layout tp fastest: ranks 0, 1 are stage 0; ranks 2, 3 stage 1.
    for rank, out in enumerate(outs):
        stage = rank // 2
        assert out["layer_numbers"] == [stage + 1]
        assert out["has_embedding"] == (stage == 0) and out["has_output_layer"] == (stage == 1)
        if stage == 1:
            assert out["output_weight_synced"]
            torch.testing.assert_close(out["loss"], ref["loss"], atol=ATOL, rtol=0)
        for name, grad in out["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], atol=ATOL, rtol=1e-4, msg=name)
    covered = set(outs[0]["grads"]) | set(outs[2]["grads"])
    assert covered == set(ref["grads"])


def _virtual_pipeline_chunks():
    from megatron.core import parallel_state as ps
    from tests.unit_tests.models import gpt_test_utils as U

    chunks = []
    for vp_rank in range(ps.get_virtual_pipeline_model_parallel_world_size()):
        ps.set_virtual_pipeline_model_parallel_rank(vp_rank)
        model, _ = U.build_gpt(
            U.gpt2_like_kwargs(num_layers=8, virtual_pipeline_model_parallel_size=2), arch="gpt2"
        )
        chunks.append(model)
    ps.set_virtual_pipeline_model_parallel_rank(0)
    out = {
        "layer_numbers": [[layer.layer_number for layer in m.decoder.layers] for m in chunks],
        "pre_post": [(m.pre_process, m.post_process) for m in chunks],
    }
    if ps.is_pipeline_first_stage(ignore_virtual=True):
        out["tied"] = chunks[0].embedding.word_embeddings.weight.detach()
    else:
        out["tied"] = chunks[-1].output_layer.weight.detach()
    return out


def test_virtual_pipeline_layer_offsets_and_tied_embeddings():
    outs = run_distributed(_virtual_pipeline_chunks, WORLD, tp=1, pp=2, vpp=2)
    # Ranks 0, 1: stage 0 (two data-parallel replicas); ranks 2, 3: stage 1.
    assert outs[0]["layer_numbers"] == [[1, 2], [5, 6]]
    assert outs[2]["layer_numbers"] == [[3, 4], [7, 8]]
    assert outs[0]["pre_post"] == [(True, False), (False, False)]
    assert outs[2]["pre_post"] == [(False, False), (False, True)]
    assert torch.count_nonzero(outs[0]["tied"]) > 0
    assert torch.equal(outs[0]["tied"], outs[2]["tied"])
