"""A text generation server started as users start it (tools/run_text_generation_server.py,
alone or under torchrun) on a loopback port, with its log; always stopped by its owner."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import requests

from tests.unit_tests.inference import hf_checkpoints as hc

REPO = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT = 240.0
REQUEST_TIMEOUT = 120.0


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server process, its base URL and its log."""

    def __init__(
        self, ckpt, tp, log_path, extra=(), flags=None, script="run_text_generation_server.py"
    ):
        """`flags` replace the default start flags (`hc.server_flags(ckpt)`: the checkpoint's
        own args and the GPT-2 tokenizer files); `extra` are added; `script` is the server
        script under tools/."""
        self.log_path = log_path
        self.script = str(REPO / "tools" / script)
        self.flags = list(flags) if flags is not None else hc.server_flags(ckpt)
        # A port found free may be taken (by another process's ephemeral socket) before the
        # server binds it; the server then refuses in one line and is started on another port.
        for attempt in range(3):
            self._start(ckpt, tp, extra)
            try:
                self._wait_ready()
                return
            except RuntimeError:
                if attempt == 2 or "cannot serve there (Address already in use)" not in (
                    self.read_log()
                ):
                    raise
                self.stop()

    def _start(self, ckpt, tp, extra):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # No architecture or layout flags: they come from the converted checkpoint.
        flags = self.flags + ["--port", str(self.port)]
        flags += list(extra)
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        if tp == 1:
            env.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
            )
            cmd = [sys.executable, self.script]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(tp),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(_free_port()),
                self.script,
            ]
        self.log = open(self.log_path, "w")  # noqa: SIM115 (open as long as the server runs)
        self.proc = subprocess.Popen(
            cmd + flags, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _wait_ready(self):
        deadline = time.time() + START_TIMEOUT
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if requests.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {START_TIMEOUT}s:\n{self.read_log()}")

    def read_log(self):
        if not self.log.closed:
            self.log.flush()
        return pathlib.Path(self.log_path).read_text()[-5000:]

    def stop(self):
        if self.proc.poll() is None:
            # The whole session: torchrun and its ranks.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self.log.close()

    def put(self, body, **kw):
        return requests.put(self.url + "/api", json=body, timeout=REQUEST_TIMEOUT, **kw)


#: The shared tensor-parallel engine server: a random tiny GPT-2 with 1024 positions (so that an
#: abandoned generation would take seconds), converted to TP 2, served by 2 ranks under torchrun
#: with small queue limits (16 running + 16 waiting) and a 0.01 GiB KV cache of 16-token blocks.
TP2_POSITIONS = 1024
TP2_MAX_BATCH = 16
TP2_MAX_WAITING = 16
TP2_FLAGS = (
    "--max-batch-size", str(TP2_MAX_BATCH), "--max-waiting-requests", str(TP2_MAX_WAITING),
    "--max-prompts", str(TP2_MAX_WAITING), "--inference-dynamic-batching-block-size", "16",
    "--inference-dynamic-batching-buffer-size-gb", "0.01",
)  # fmt: skip


def start_tp2_engine_server(root):
    """(server, the HF model it serves) for the session's `tp2_server` fixture."""
    from tests.functional_tests import convert_utils as cu

    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt_tp2")
    hf = hc.build_hf_model("gpt2", max_positions=TP2_POSITIONS)
    hf.save_pretrained(hf_dir, safe_serialization=True)
    cu.convert(
        "--loader", "hf", "--saver", "mcore", "--load-dir", hf_dir, "--save-dir", ckpt,
        "--target-tensor-parallel-size", "2",
    )  # fmt: skip
    return Server(ckpt, 2, str(root / "server.log"), extra=TP2_FLAGS), hf


def health(server):
    return requests.get(server.url + "/health", timeout=REQUEST_TIMEOUT).json()
