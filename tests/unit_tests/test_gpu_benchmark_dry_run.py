"""benchmarks/gpu/run_all.sh --dry-run: the prepared GPU check runs end to end on the CPU with tiny
sizes (every section, the summary, the MoE and context-parallel benchmarks on the code paths they
take on a GPU), so the command is ready when a GPU is lent."""

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_run_all_dry_run(tmp_path):
    env = dict(os.environ, OUT_DIR=str(tmp_path), OMP_NUM_THREADS='1')
    proc = subprocess.run(
        ['bash', os.path.join(REPO, 'benchmarks', 'gpu', 'run_all.sh'), '--dry-run'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / 'summary.txt').read_text()
    for section in (
        'RESULT environment:',
        'RESULT gpu tests: skipped (dry run)',
        'RESULT peak:',
        'RESULT train bf16:',
        'RESULT train bf16 vs plain PyTorch+SDPA:',
        'RESULT memory:',
        'RESULT generate batch 1:',
        'RESULT generate batch 8:',
        # The MoE and CP benchmarks run their GPU code paths on the CPU, tiny.
        'RESULT bench_moe cpu fp32: ours / HF Mixtral tokens/s',
        'RESULT bench_moe cpu fp32: grouped / sequential tokens/s',
        'RESULT context parallel: seq 64 torch.bfloat16 (CPU flash block):',
        'RESULT context parallel: seq 64 torch.float32 (CPU flash block):',
        'RESULT context parallel: seq 64 CP2 p2p: ratio tokens/s CP2/CP1',
    ):
        assert section in summary, (section, summary)
    assert 'FAILED' not in summary and 'TIMED OUT' not in summary, summary
    assert not re.search(r'^RESULT (moe|context parallel): .*skipped', summary, re.M), summary
    # CP is exact: the CP2 runs' first loss equals CP1's.
    for line in summary.splitlines():
        if 'CP2/CP1' in line:
            assert float(line.rsplit('loss diff to CP1 ', 1)[1]) < 1e-5, line
    assert 'finite: True' in summary and '): OK' in summary  # fp16 follows the bf16 curve
    assert 'identical greedy tokens 100%' in summary  # fp32 on the CPU: the same tokens as HF
    assert (tmp_path / 'train_losses.json').exists()
