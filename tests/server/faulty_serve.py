"""`kiln serve` with failures injected into the requests that carry one of `FAULTS`' seeds, each at
one stage of a request's life and each of an exception type kiln never raises itself: run as
`python -m tests.server.faulty_serve serve MODEL_DIR ...` (the same arguments as `kiln`).

A seed of `KILL_ENGINE` raises outside any request's work, in the engine thread's own loop: the
server must then exit non-zero instead of answering 503 for ever."""

import sys
import time

FAULTS = {
    7001: "preparation",  # Engine.add_request, on the engine thread
    7002: "adjustment",   # adjust_logits (the request asks for a penalty, so its row is adjusted)
    7003: "sampling",     # sample
    7004: "output",       # Engine._output, after the token is appended and stop strings checked
    7005: "response",     # the route's JSON for the choice
}
NAN_PROMPT_SCORES = 7006
"""Its prompt's scoring logits hold NaN and -inf: prompt logprobs of NaN and -inf must still be JSON."""
SLOW_STEPS = 7008
"""While a request with this seed runs, every step takes 0.1 s longer: requests that outlast a deadline."""
KILL_ENGINE = 7999


class Injected(LookupError):
    """No kiln code raises or catches this type."""


def _seeded(params, seed: int) -> bool:
    return getattr(params, "seed", None) == seed


def install() -> None:
    from kiln.runtime import async_engine, engine
    from kiln.server import serving

    real_add, real_output = engine.Engine.add_request, engine.Engine._output
    real_adjust, real_sample = engine.adjust_logits, engine.sample
    real_choice, real_score = serving.CompletionChoices.choice, engine.Engine._score_prompt
    real_drain = async_engine.AsyncEngine._drain

    def add_request(self, ids, params, *args, **kwargs):
        if _seeded(params, 7001):
            raise Injected("preparation")
        return real_add(self, ids, params, *args, **kwargs)

    def adjust_logits(logits, adjustments, *args):
        if any(a is not None and _seeded(a.params, 7002) for a in adjustments):
            raise Injected("adjustment")
        return real_adjust(logits, adjustments, *args)

    def sample(logits, params, *args):
        if any(_seeded(p, 7003) for p in params):
            raise Injected("sampling")
        return real_sample(logits, params, *args)

    def output(self, seq, cut):
        if _seeded(seq.params, 7004) and len(seq.output_token_ids) >= 2:
            raise Injected("output")
        return real_output(self, seq, cut)

    def choice(self, index, out, text, first):
        if self.body.seed == 7005:
            raise Injected("response")
        return real_choice(self, index, out, text, first)

    def score_prompt(seq, logits):
        if _seeded(seq.params, NAN_PROMPT_SCORES):
            logits = logits.clone()
            logits[0, :] = float("nan")
            logits[1, :] = float("-inf")
            logits[1, 0] = 0.0
        return real_score(seq, logits)

    def drain(self):
        real_drain(self)
        scheduler = self.engine.scheduler
        if any(_seeded(s.params, KILL_ENGINE) for s in scheduler.waiting):
            raise Injected("the engine thread itself")
        if any(_seeded(s.params, SLOW_STEPS) for s in (*scheduler.running, *scheduler.waiting)):
            time.sleep(0.1)

    engine.Engine.add_request, engine.Engine._output = add_request, output
    engine.adjust_logits, engine.sample = adjust_logits, sample
    engine.Engine._score_prompt = staticmethod(score_prompt)
    serving.CompletionChoices.choice = choice
    async_engine.AsyncEngine._drain = drain


if __name__ == "__main__":
    install()
    from kiln.cli import main

    sys.exit(main(sys.argv[1:]))
