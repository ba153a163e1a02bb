"""The engine as the server uses it: progress every step, abort, no cycles keeping requests alive;
incremental detokenization and chat templates."""

import gc
import json
import weakref

import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def llm(demo_dirs) -> LLM:
    return LLM(demo_dirs["llama"], max_num_seqs=4)


def test_step_reports_progress_and_the_finish(llm):
    engine = llm.engine
    rid = engine.add_request(llm.tokenizer.encode("The kiln"), SamplingParams(max_tokens=5, temperature=0))
    seen = []
    while engine.has_unfinished():
        seen += [o for o in engine.step() if o.request_id == rid]
    assert [len(o.token_ids) for o in seen] == [1, 2, 3, 4, 5]
    assert [o.finished for o in seen] == [False] * 4 + [True] and seen[-1].finish_reason == "length"
    assert all(b.text.startswith(a.text) for a, b in zip(seen, seen[1:]))
    assert seen[-1].text == llm.tokenizer.decode(seen[-1].token_ids)


def test_abort_frees_blocks_and_finished_requests_are_not_kept_alive(llm):
    engine = llm.engine
    gc.collect()
    gc.disable()  # only reference counting frees now: a cycle would keep the sequence alive
    try:
        keep = engine.add_request(llm.tokenizer.encode("The kiln"), SamplingParams(max_tokens=50, temperature=0))
        drop = engine.add_request(llm.tokenizer.encode("Why"), SamplingParams(max_tokens=50, temperature=0))
        engine.step()
        seqs = {s.request_id: weakref.ref(s) for s in engine.scheduler.running}
        assert engine.abort(drop) and not engine.abort(drop) and not engine.abort("nope")
        assert seqs[drop]() is None  # aborted: gone at once
        used = engine.scheduler.kv_usage
        assert 0 < used
        while engine.has_unfinished():
            engine.step()
        assert seqs[keep]() is None and engine.scheduler.kv_usage == 0 and not engine._prompts
    finally:
        gc.enable()


def test_incremental_detokenizer_never_splits_a_character(llm):
    tok = llm.tokenizer
    text = "The kiln glows: naïve potters wait, 火 and 🔥 beside the jars."
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) // 3  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"))
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas) and "" in deltas  # held back until complete
    assert "".join(deltas) == detok.text == tok.decode(ids) == text


def test_chat_template_from_tokenizer_config(demo_dirs, tmp_path):
    model = tmp_path / "chat"
    model.mkdir()
    for f in demo_dirs["llama"].iterdir():
        (model / f.name).symlink_to(f)
    config = json.loads((demo_dirs["llama"] / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(model)
    eos = config["eos_token"]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == f"<user>hi{eos}<assistant>"
    assert Tokenizer(demo_dirs["llama"]).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False) == "User: hi\n"


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_equal_transformers_log_softmax(demo_dirs, hf_models, chunk):
    """Every prompt token after the first, prefilled whole or in chunks of 5 tokens."""
    import torch

    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(demo_dirs["llama"], max_num_seqs=4, **kwargs)
    ids = llm.tokenizer.encode("Loading the kiln is careful work. Large jars go to the back")
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    with torch.no_grad():
        want = hf_models["llama"](torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), expected, rtol=0, atol=1e-4)
    for pos, top in enumerate(out.prompt_top_logprobs[1:]):
        values, tokens = want[pos].topk(3)
        assert list(top) == tokens.tolist()
        torch.testing.assert_close(torch.tensor(list(top.values())), values, rtol=0, atol=1e-4)
    ranks = [int((want[pos] > want[pos, t]).sum()) + 1 for pos, t in enumerate(ids[1:])]
    assert out.prompt_ranks[1:] == ranks


def test_min_tokens_holds_off_eos_and_stop_tokens(llm):
    eos = next(iter(llm.engine.eos_token_ids))
    forced = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0})
    assert llm.generate(["The kiln"], forced)[0].token_ids == [eos]
    held = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0, 7: 90.0}, min_tokens=3,
                          stop_token_ids=[7])
    out = llm.generate(["The kiln"], held)[0]
    assert eos not in out.token_ids[:3] and 7 not in out.token_ids[:3]
    assert len(out.token_ids) == 4 and out.token_ids[3] == eos and out.finish_reason == "stop"


@pytest.mark.parametrize("stage", ["_score_prompt", "_check_stop", "_output"])
def test_a_request_that_raises_fails_alone_and_frees_its_blocks(llm, monkeypatch, stage):
    """One request's own work raising (here a type kiln never raises): it ends with finish reason
    "error" and its exception; the others in its steps get the tokens they get alone."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.scheduler import Sequence

    class Odd(Exception):
        pass

    prompts = ["The kiln", "Why", "On the third morning"]
    params = [SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=6, temperature=0.9, seed=4),
              SamplingParams(max_tokens=6, temperature=0, presence_penalty=0.4, prompt_logprobs=1)]
    alone = [llm.generate([p], [s])[0] for p, s in zip(prompts, params)]
    victim = SamplingParams(max_tokens=6, temperature=0, seed=99, prompt_logprobs=0)
    real = getattr(Engine, stage)

    def broken(*args):
        if next(a for a in args if isinstance(a, Sequence)).params is victim:
            raise Odd(stage)
        return real(*args)

    monkeypatch.setattr(Engine, stage, staticmethod(broken) if stage == "_score_prompt" else broken)
    outs = llm.generate(["Numbers matter", *prompts], [victim, *params])
    assert outs[0].finish_reason == "error" and isinstance(outs[0].error, Odd)
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in alone]
    assert [o.finish_reason for o in outs[1:]] == ["length"] * 3
    assert llm.engine.scheduler.kv_usage == 0 and not llm.engine._prompts


def test_stop_strings_are_found_where_a_search_of_each_finds_them():
    """The prepared search (by length, at the newest characters) against str.find of every stop string."""
    import random

    from kiln.runtime.stop_strings import StopStrings

    rng = random.Random(0)
    for _ in range(300):
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        found, text, prepared = None, "", StopStrings(stop)
        while found is None and len(text) < 40:
            new = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
            text += new
            tail = len(text) - len(new)
            cuts = [i for i in (text.find(s, max(tail - len(s) + 1, 0)) for s in stop) if i >= 0]
            found = prepared.find(text, len(new))
            assert (found and found[0]) == (min(cuts) if cuts else None), (stop, text, new)
            if found is not None:
                assert text[found[0]:].startswith(found[1]) and found[1] in stop
        assert prepared.longest == max(map(len, stop))


def test_a_request_finishing_as_its_client_aborts_is_ended_once(llm):
    """The engine thread delivers a request's last output while the event loop aborts it: whichever comes
    second finds it gone (it used to find the entry with `get` and then fail to `del` it, killing the
    engine thread with a KeyError)."""
    import asyncio

    from kiln.runtime.async_engine import AsyncEngine, _Choices, _Stream
    from kiln.runtime.engine import RequestOutput

    engine = AsyncEngine(llm.engine)  # not started: the two sides are called in the order under test
    loop = asyncio.new_event_loop()

    class AbortedBetween(dict):  # `abort` runs on the event loop just after the engine thread looked it up
        def get(self, key, default=None):
            found = super().get(key, default)
            engine.abort(key)
            return found

    def last(request_id: str) -> RequestOutput:
        return RequestOutput(request_id, None, [1], [2], "", None, None, "length")

    try:
        for order in ("deliver, abort inside", "abort, deliver", "deliver, abort"):
            engine._streams = AbortedBetween() if order == "deliver, abort inside" else {}
            engine._streams["r"] = stream = _Stream(loop, asyncio.Queue(), 1, 1, _Choices(1, 1))
            if order == "abort, deliver":
                engine.abort("r")
            engine._deliver("r", last("r"))
            engine.abort("r")
            loop.run_until_complete(asyncio.sleep(0))
            assert not engine._streams and stream.outputs.qsize() == (order != "abort, deliver"), order
    finally:
        loop.close()
