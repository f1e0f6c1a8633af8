"""The `moe` argument group: Megatron core_r0.8.0's mixture-of-experts flags, plus the MoE flags of
later Megatron versions (same names and defaults). Split off arguments_model.py, which
re-exports `_add_moe_args`."""


def _add_moe_args(parser):
    group = parser.add_argument_group(title='moe')
    group.add_argument(
        '--expert-model-parallel-size',
        type=int,
        default=1,
        help='Expert-parallel size.',
    )
    group.add_argument(
        '--num-experts',
        type=int,
        default=None,
        help='Experts per MoE layer (unset: a dense model).',
    )
    group.add_argument(
        '--moe-router-topk',
        type=int,
        default=2,
        help='Experts each token is sent to.',
    )
    group.add_argument(
        '--moe-router-load-balancing-type',
        type=str,
        default='aux_loss',
        choices=['aux_loss', 'seq_aux_loss', 'sinkhorn', 'none'],
        help='How the router keeps the experts evenly loaded.',
    )
    group.add_argument(
        '--moe-aux-loss-coeff',
        type=float,
        default=0.0,
        help='Weight of the load-balancing auxiliary loss.',
    )
    group.add_argument(
        '--moe-z-loss-coeff', type=float, default=None, help='Weight of the router z-loss.'
    )
    group.add_argument(
        '--moe-grouped-gemm', action='store_true', help='Run the local experts as one grouped GEMM.'
    )
    group.add_argument(
        '--moe-token-dispatcher-type',
        type=str,
        choices=['allgather', 'alltoall'],
        default='allgather',
        help='How tokens travel to their experts.',
    )
    group.add_argument(
        '--moe-router-pre-softmax',
        action='store_true',
        help='Softmax over all experts before the top-k choice (instead of over the chosen ones).',
    )
    group.add_argument(
        '--moe-input-jitter-eps',
        type=float,
        default=None,
        help='Multiply the router input by uniform noise in [1 - eps, 1 + eps] while training.',
    )
    group.add_argument(
        '--moe-per-layer-logging',
        action='store_true',
        help='Log the auxiliary and z losses of each MoE layer.',
    )
    group.add_argument(
        '--moe-expert-capacity-factor',
        type=float,
        default=None,
        help='Tokens an expert takes, as a multiple of an even share (unset: no token is dropped).',
    )
    group.add_argument(
        '--moe-pad-expert-input-to-capacity',
        action='store_true',
        help='Pad each expert input up to the capacity.',
    )
    group.add_argument(
        '--moe-token-drop-policy',
        type=str,
        default='probs',
        choices=['probs', 'position'],
        help='Which tokens over capacity are dropped: lowest "probs" or last "position".',
    )
    group.add_argument(
        '--moe-layer-recompute',
        action='store_true',
        help='Recompute the MoE layer in the backward pass to save memory.',
    )
    group.add_argument(
        '--moe-extended-tp',
        action='store_true',
        help='Shard every expert over the TP x EP ranks instead of expert parallelism.',
    )
    # Flags of later Megatron versions (same names and defaults).
    group.add_argument(
        '--moe-router-score-function',
        type=str,
        default='softmax',
        choices=['softmax', 'sigmoid'],
        help='Score function of the router: softmax, or sigmoid (renormalized over the top-k).',
    )
    group.add_argument(
        '--moe-router-topk-scaling-factor',
        type=float,
        default=None,
        help='Multiply the top-k routing scores by this factor.',
    )
    group.add_argument(
        '--moe-router-enable-expert-bias',
        action='store_true',
        help='Aux-loss-free load balancing: a per-expert bias added to the routing scores for '
        'the top-k selection only, updated once per global batch from the token counts.',
    )
    group.add_argument(
        '--moe-router-bias-update-rate',
        type=float,
        default=1e-3,
        help='Step of the expert bias update (bias += rate * sign(mean count - count)).',
    )
    group.add_argument(
        '--moe-router-dtype',
        type=str,
        default=None,
        choices=['fp32', 'fp64'],
        help='dtype of the router GEMM and routing scores (default: the model dtype).',
    )
    group.add_argument(
        '--moe-ffn-hidden-size',
        type=int,
        default=None,
        help='ffn hidden size of each routed expert (default: --ffn-hidden-size).',
    )
    group.add_argument(
        '--moe-shared-expert-intermediate-size',
        type=int,
        default=None,
        help='ffn hidden size of the shared experts every token goes through (default: none).',
    )
    group.add_argument(
        '--moe-shared-expert-gate',
        action='store_true',
        help='Scale the shared experts\' output by a sigmoid gate per token (Qwen2-MoE).',
    )
    group.add_argument(
        '--moe-layer-freq',
        type=moe_freq_type,
        default=1,
        help='Which layers are MoE: an integer N makes every N-th layer (0, N, 2N, ...) MoE; a '
        'list expression such as "([0]+[1]*23)" gives 0 (dense) or 1 (MoE) per layer.',
    )
    return parser


def moe_freq_type(value):
    """--moe-layer-freq: an int, or a list expression of 0/1 built from lists, ints, + and *
    (e.g. "[0]*3+[1]*29"), evaluated without eval()."""
    import ast

    def evaluate(node):
        if isinstance(node, ast.Expression):
            return evaluate(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [evaluate(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(node)

    try:
        result = evaluate(ast.parse(str(value).strip(), mode='eval'))
    except (SyntaxError, ValueError, TypeError):
        result = None
    if isinstance(result, int) or (
        isinstance(result, list) and all(isinstance(x, int) for x in result)
    ):
        return result
    import argparse

    raise argparse.ArgumentTypeError(
        f'--moe-layer-freq expects an integer or a list expression like "[0]+[1]*3", got {value!r}'
    )
