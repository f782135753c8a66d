"""The README's main command on a fresh machine: `python -m deltaserve serve` (what scripts/serve.sh runs)
loads the shipped demo model, answers a chat request, and on SIGTERM finishes the in-flight stream and exits 0."""

import os
import signal
import subprocess
import sys

import httpx
import openai

from tests.server.harness import free_port, wait_for_health


def test_serve_demo_model_then_sigterm(tmp_path):
    port = free_port()
    env = dict(os.environ)
    env.pop("DELTASERVE_API_KEY", None)
    env.pop("VLLM_API_KEY", None)
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", "--port", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base_url, timeout=120, alive=lambda: server.poll() is None)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello!"}],
                                               max_tokens=8)
        assert isinstance(reply.choices[0].message.content, str) and reply.usage.completion_tokens > 0

        body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.send_signal(signal.SIGTERM)  # mid-stream: the request is allowed to finish
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    output = log_path.read_text()
    assert "demo model" in output and "Traceback" not in output
