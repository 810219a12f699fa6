"""An adapter minimlx saves (PEFT's files) in llama.cpp: its `convert_lora_to_gguf.py` converts it (conftest.py's
`fused_families`), and llama-server with `--lora` on the GGUF of the base gives the greedy tokens minimlx gives with
the adapter. llama-server is built from the vendored sources into the test cache (tests/llamacpp.py's `llamacpp_tool`;
.ci/run builds it before the tests)."""

import json
import subprocess
import tempfile
import time
import urllib.request

import pytest
from llamacpp import llamacpp_tool
from servers import free_port

import minimlx
from minimlx.decode import Engine, Request, SamplingSettings

PROMPT = [5, 17, 230, 41, 9, 1200, 77]


def llama_server_tokens(base, adapter, prompt: list[int], count: int) -> list[int]:
    """llama-server's greedy tokens after the token ids `prompt`, on the GGUF `base` with the GGUF adapter `adapter`."""
    port = free_port()
    binary = str(llamacpp_tool("llama-server"))
    command = [binary, "-m", str(base), "--lora", str(adapter), "--port", str(port), "-c", "256"]
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen([*command, "-t", "2", "--no-warmup"], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        pytest.fail(f"llama-server did not start: {log.read()[-3000:]}")
                    time.sleep(0.2)
            body = {"prompt": prompt, "n_predict": count, "temperature": 0, "top_k": 1, "return_tokens": True}
            body |= {"cache_prompt": False, "samplers": ["top_k"]}
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            return json.loads(urllib.request.urlopen(request, timeout=60).read())["tokens"]
        finally:
            server.terminate()
            server.wait(10)


@pytest.mark.slow
def test_llama_cpp_applies_minimlx_s_saved_adapter_as_minimlx_does(fused_families):
    base, adapter = fused_families / "llama", fused_families / "llama-minimlx-adapter"
    tokenizer = minimlx.load(base, "float32")[1]
    expected = []
    for applied in (None, adapter):
        adapted, _ = minimlx.load(base, "float32", adapter=applied)
        engine = Engine(adapted, tokenizer, max_batch=1)
        generation = engine.submit(
            Request(PROMPT, SamplingSettings(max_tokens=12, temperature=0), stop_ids=frozenset())
        )
        engine.run()
        expected.append(generation.tokens)
    assert expected[0] != expected[1]  # the adapter changes the answer
    gguf_base, gguf_adapter = fused_families / "llama-f32.gguf", fused_families / "llama-minimlx-adapter.gguf"
    assert llama_server_tokens(gguf_base, gguf_adapter, PROMPT, 12) == expected[1]
