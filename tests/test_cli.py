"""The `kiln` command as a user runs it: a fresh process, real files, one-line errors."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import alive, children, free_port, serving


def kiln(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "kiln", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr)
    return proc


def test_demo_model_then_generate(tmp_path):
    out = tmp_path / "demo"
    made = kiln("demo-model", out, "--arch", "qwen3", "--num-layers", "2", "--train-steps", "20")  # trained a little
    assert made.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    proc = kiln("generate", out, "--prompt", "The kiln was", "--max-tokens", "8")
    assert proc.stdout.startswith("The kiln was") and len(proc.stdout.strip()) > len("The kiln was")
    # greedy is deterministic across processes
    assert kiln("generate", out, "--prompt", "The kiln was", "--max-tokens", "8").stdout == proc.stdout
    schema = {"type": "object", "properties": {"kind": {"enum": ["kiln", "oven"]}, "w": {"type": "integer",
              "minimum": 0, "maximum": 99}}, "required": ["kind", "w"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    proc = kiln("generate", out, "--prompt", "The kiln was", "--prompt", "Why", "--max-tokens", "40",
                "--temperature", "1", "--json-schema", tmp_path / "schema.json")
    docs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(docs) == 2 and all(d["kind"] in ("kiln", "oven") and 0 <= d["w"] <= 99 for d in docs)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir() or (d / "config.json").write_text('{"architectures": ["BertModel"]}'),
         "unsupported architecture BertModel"),
        (lambda d: d.mkdir() or (d / "config.json").write_text("{not json"), "is not valid JSON"),
    ],
    ids=["missing-dir", "unsupported-arch", "bad-json"],
)
def test_errors_are_one_line_without_traceback(tmp_path, setup, message):
    model = tmp_path / "m"
    setup(model)
    proc = kiln("generate", model, "--prompt", "x", check=False)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kiln: error:") and message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("device, message", [("gpu", "unknown device 'gpu'"), ("mps", "not 'mps'"),
                                             ("cuda:0", "sees no CUDA GPU: use --device cpu")])
def test_a_device_it_cannot_use_is_one_line(demo_dirs, device, message):
    import torch

    if device == "cuda:0" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = kiln("compile", demo_dirs["llama"], "--device", device, check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and message in proc.stderr


@pytest.mark.parametrize("make", ["a plain file", "a link loop"])
def test_a_cache_that_cannot_be_a_directory_is_one_line(demo_dirs, tmp_path, make):
    """A cache path that is a file or a symlink loop: one `kiln: error:` line naming it, no traceback."""
    cache = tmp_path / "cache"
    if make == "a plain file":
        cache.write_text("not a directory")
    else:
        cache.symlink_to(tmp_path / "loop")
        (tmp_path / "loop").symlink_to(cache)
    proc = kiln("generate", demo_dirs["llama"], "--prompt", "x", "--max-tokens", "2", "--compile", "--cache-dir", cache,
                check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"kiln: error: cannot use {cache}") and "--cache-dir, $KILN_CACHE" in proc.stderr
    commands = [["cache", *c, "--cache-dir", str(cache)] for c in (["ls"], ["info", "abc"], ["prune", "-n", "--older-than", "1d"])]
    answers = subprocess.run([sys.executable, "-c", _EACH_COMMAND, json.dumps(commands)], capture_output=True,
                             text=True, timeout=120)  # one process: each `kiln` start costs seconds
    for rc, stderr in json.loads(answers.stdout):  # not "no artifacts": the real cause
        assert rc == 1 and stderr.startswith(f"kiln: error: cannot use {cache}"), stderr


_EACH_COMMAND = """
import contextlib, io, json, sys
from kiln.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        answers.append((main(argv), err.getvalue()))
print(json.dumps(answers))
"""


def test_a_killed_compile_leaves_no_worker_behind(demo_dirs, tmp_path):
    """SIGKILL on `kiln compile` while its forked workers compile: they die with it (they used to live on,
    re-parented, ~350 MB each, blocked writing to a pipe nobody reads)."""
    env = {**os.environ, "KILN_COMPILE_WORKERS": "2", "KILN_PIECE_CACHE": str(tmp_path / "pieces")}  # all to compile
    argv = [sys.executable, "-m", "kiln", "compile", str(demo_dirs["qwen3"]), "--cache-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    command = "\0".join(argv).encode() + b"\0"  # a forked worker's; not read from /proc before the exec
    deadline = time.monotonic() + 180
    try:
        while len(workers := [p for p in children(proc.pid) if _cmdline(p) == command]) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no compile workers were forked"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, workers)), "compile workers outlived their killed parent"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_kv_cache_too_small_for_one_sequence_names_the_options(demo_dirs):
    proc = kiln("generate", demo_dirs["llama"], "--prompt", "x", "--kv-cache-memory", "64K", "--max-model-len", "64",
                check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "the KV cache holds 32 tokens, less than max_model_len 64" in proc.stderr
    assert "(--kv-cache-memory, --memory-utilization)" in proc.stderr and "(--max-model-len)" in proc.stderr
    capped = kiln("generate", demo_dirs["llama"], "--prompt", "x", "--kv-cache-memory", "64K", "--max-tokens", "8")
    assert "max_model_len capped to 32 tokens" in capped.stderr and capped.stdout.strip()


def test_help_lists_commands():
    out = kiln("--help").stdout
    assert "generate" in out and "demo-model" in out


def test_serve_options_reach_the_server_config():
    """Each of serve's parser options lands in ServerConfig, and a name outside vLLM's is refused by argparse."""
    from kiln.cli import _server_config, build_parser

    args = build_parser().parse_args(["serve", "m", "--tool-call-parser", "mistral", "--reasoning-parser", "qwen3",
                                      "--pooling", "mean"])
    config = _server_config(args)
    assert (config.tool_call_parser, config.reasoning_parser, config.pooling) == ("mistral", "qwen3", "mean")
    assert _server_config(build_parser().parse_args(["serve", "m"])).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--tool-call-parser", "pythonic"])


def test_help_imports_no_torch():
    """`kiln ... --help` answers in a fraction of a second: building the parser imports no torch."""
    code = ("import sys\nfrom kiln.cli import main\nfor cmd in ('generate', 'compile', 'serve', 'demo-model', "
            "'cache', 'bench'):\n    try:\n        main([cmd, '--help'])\n    except SystemExit:\n        pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'triton'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_serve_from_the_artifact(demo_dirs, kiln_cache, llama_artifact, tmp_path):
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "kiln", "-v", "serve", str(demo_dirs["llama"]), "--port", str(port),
           "--cache-dir", str(kiln_cache), "--require-artifact", "--served-model-name", "potter"]
    with serving(cmd, port, tmp_path / "serve.log") as url:
        body = {"model": "potter", "prompt": "The kiln was", "max_tokens": 6, "temperature": 0}
        out = httpx.post(f"{url}/v1/completions", json=body).json()
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 6
    text = (tmp_path / "serve.log").read_text()
    assert f"loaded artifact {llama_artifact.name}" in text and "ready: http://127.0.0.1" in text
    assert "compiling" not in text


def test_serve_over_https_with_an_api_key_and_cors(demo_dirs, kiln_cache, llama_artifact, tmp_path):
    """`kiln serve` with a self-signed certificate, KILN_API_KEY and one allowed origin, as the openai
    client and a browser's preflight see it."""
    import socket
    import ssl

    import httpx
    import openai
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(tmp_path / "cert.pem", append=i > 0)
    trust = ssl.create_default_context()
    ca.configure_trust(trust)
    port = free_port()
    cmd = [sys.executable, "-m", "kiln", "-v", "serve", str(demo_dirs["llama"]), "--port", str(port),
           "--cache-dir", str(kiln_cache), "--require-artifact", "--served-model-name", "m",
           "--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "cert.pem"),
           "--allowed-origins", "https://app.example", "--api-key-scope", "all", "--auth-exempt", "/health"]
    env = {**os.environ, "KILN_API_KEY": "s3cret"}
    with serving(cmd, port, tmp_path / "serve.log", env=env, scheme="https", verify=trust) as url:
        # clients are closed before the server stops: TLS waits up to 30 s for an open one to say goodbye
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0,
                           http_client=httpx.Client(verify=trust)) as client:
            out = client.completions.create(model="m", prompt="The kiln was", max_tokens=4, temperature=0)
            assert out.usage.completion_tokens == 4
        with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0,
                           http_client=httpx.Client(verify=trust)) as client, pytest.raises(openai.AuthenticationError):
            client.models.list()
        with pytest.raises(openai.APIConnectionError):  # a client that does not trust the certificate
            openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0).models.list()
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        allowed = httpx.options(url + "/v1/completions", verify=trust,
                                headers={"Origin": "https://app.example", **preflight})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(url + "/v1/completions", verify=trust, headers={"Origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in other.headers
        assert httpx.get(url + "/metrics", verify=trust).status_code == 401  # scope all: every path but /health
        assert httpx.get(url + "/openapi.json", verify=trust).status_code == 401
        assert httpx.get(url + "/health", verify=trust).status_code == 200
        # TLS 1.2 offers the AEAD suites (uvicorn's old default, the cipher string "TLSv1", offered only CBC-SHA1)
        tls12 = ssl.create_default_context()
        ca.configure_trust(tls12)
        tls12.maximum_version = ssl.TLSVersion.TLSv1_2
        tls12.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20")
        with socket.create_connection(("127.0.0.1", port)) as raw, tls12.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.version() == "TLSv1.2" and ("GCM" in tls.cipher()[0] or "CHACHA20" in tls.cipher()[0])
    assert f"ready: https://127.0.0.1:{port}" in (tmp_path / "serve.log").read_text()


def test_serve_refuses_bad_security_options_before_loading(demo_dirs, tmp_path):
    proc = kiln("serve", demo_dirs["llama"], "--ssl-keyfile", tmp_path / "none.pem", "--ssl-certfile",
                tmp_path / "none.pem", check=False)
    assert proc.returncode == 1 and "--ssl-keyfile" in proc.stderr and "no such file" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = kiln("serve", demo_dirs["llama"], "--auth-exempt", "/v1/models", check=False)
    assert proc.returncode == 2 and "--auth-exempt" in proc.stderr
    proc = kiln("serve", demo_dirs["llama"], "--api-key", "k", "--auth-exempt", "/metrics", check=False)
    assert proc.returncode == 1 and "--api-key-scope all" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_without_an_artifact_when_one_is_required(demo_dirs, tmp_path):
    proc = kiln("serve", demo_dirs["llama"], "--cache-dir", tmp_path, "--require-artifact", check=False)
    assert proc.returncode == 1 and "no artifact" in proc.stderr and "Traceback" not in proc.stderr
